"""The verifier: the similarity threshold is a first filter, not the decision.

A bi-encoder embeds a sentence as a bag of meaning. It puts "flights to
Paris" next to "flights to Rome", "is X safe" next to "is X not safe", and a
sentence next to its word-swapped twin (PAWS pairs score ~0.96 either way).
Serving the cached answer to those is the wrong answer the cache could have
caught, so every candidate above the threshold is re-checked here, on the
normalised text of both questions, by rules that each reject one known trap:

* ``negation``      different count of negators (not, never, no, n't, without...).
* ``number``        different numbers, number words, ordinals (so years and dates).
* ``symbol``        different operators (C# / C++, = / ==).
* ``contrast``      a word on one side, its opposite on the other (up/down,
                    before/after, best/worst, man/woman...).
* ``entity``        a name (capitalised mid-sentence, acronym, letters with
                    digits) the other side does not mention.
* ``question_kind`` why / when / where / who / how many... differ, or a yes/no
                    question against a wh-question: another kind of answer.
* ``content``       a content word (not a stop or filler word, compared by a
                    crude stem) on one side only: an added qualifier
                    ("crashing" / "crashing continuously") or a swapped topic
                    ("learn python" / "learn java").
* ``word_order``    shared content words and numbers in another order
                    (who-did-what-to-whom: "Ted is John's son").

The rules look only at differences and err towards a miss: a false miss costs
one upstream call, a false hit serves someone a wrong answer. Calibrated on
the development pairs in ``shared/data/pairs`` (``bench/semantic_eval.py``);
there, QQP's non-duplicates that pass every rule are mostly label noise
("What is the best cab service in pune?" / "Which is ... in Pune?").

Why no learned verifier (measured on all 40,427 QQP pairs, 5-fold
cross-validation, candidates at cosine >= 0.85): at <= 0.8% false hits,
logistic regression on [u*v, |u-v|] plus rule features reached 12-14% recall,
gradient-boosted trees 15.5%, and adding BERTScore-style token alignment
from MiniLM's own contextual token vectors did not help (14.4%); these rules
give 14.5% at 0.93%. A cross-encoder (MiniLM with LoRA adapters, trained on
half of QQP, scored on the other half: ``bench/semantic_judge.py``) reached
13.2% alone at 1.0%, and 20.4% at 1.0% as an alternative path beside these
rules (17.2% at 0.80% on the same pairs): three points for a second model on
every candidate. Past that point the remaining non-duplicates (0.9% of
them pass every rule at cosine >= 0.90) look like duplicates to any reader,
so the ceiling is the labels and the bi-encoder, not the rule set.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

_TOKEN = re.compile(r"\d+(?:[.,:/]\d+)*(?:st|nd|rd|th|s|k|m|%)?|\w+(?:['’]\w+)*[+#]*", re.UNICODE)
# Operators and symbols that carry meaning in technical questions (C# vs C++, = vs ==).
_SYMBOLS = re.compile(r"[+#=<>*/&|^~%$@\\]+")

_NEGATORS = frozenset(
    "not no never nor neither nobody nothing none nowhere without cannot cant dont doesnt didnt isnt "
    "arent wasnt werent wont wouldnt shouldnt couldnt havent hasnt hadnt aint mustnt neednt".split()
)

_NUMBER_WORDS = {
    "zero": "0", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7",
    "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "thirteen": "13",
    "fourteen": "14", "fifteen": "15", "sixteen": "16", "seventeen": "17", "eighteen": "18",
    "nineteen": "19", "twenty": "20", "thirty": "30", "forty": "40", "fifty": "50", "sixty": "60",
    "seventy": "70", "eighty": "80", "ninety": "90", "hundred": "100", "thousand": "1000",
    "million": "1000000", "billion": "1000000000", "dozen": "12", "first": "1st", "second": "2nd",
    "third": "3rd", "fourth": "4th", "fifth": "5th", "sixth": "6th", "seventh": "7th", "eighth": "8th",
    "ninth": "9th", "tenth": "10th", "half": "0.5", "twice": "x2", "double": "x2", "triple": "x3",
    "once": "x1",
}

# Pairs that flip an answer; matched on whole lower-case words.
_CONTRAST_PAIRS = """
up/down in/out inside/outside into/out on/off before/after above/below over/under best/worst better/worse
good/bad pros/cons advantages/disadvantages advantage/disadvantage increase/decrease increases/decreases
higher/lower high/low rise/fall rose/fell buy/sell buying/selling open/close opening/closing win/lose
gain/lose max/min maximum/minimum more/less most/least large/small big/small big/little long/short
fast/slow hot/cold old/new young/old true/false legal/illegal possible/impossible male/female man/woman
men/women boy/girl boys/girls husband/wife father/mother son/daughter brother/sister north/south
east/west left/right start/stop begin/end import/export send/receive push/pull enable/disable add/remove
install/uninstall encrypt/decrypt always/sometimes all/some before/since from/to cheap/expensive
easy/hard easiest/hardest fold/unfold folding/unfolding catch/miss catching/missing asleep/awake
lowest/highest yesterday/tomorrow today/tomorrow today/yesterday past/future love/hate like/dislike
agree/disagree accept/reject positive/negative rich/poor strong/weak safe/dangerous healthy/unhealthy
""".split()
_CONTRAST: dict[str, frozenset[str]] = {}
for _pair in _CONTRAST_PAIRS:
    _x, _y = _pair.split("/")
    _CONTRAST[_x] = _CONTRAST.get(_x, frozenset()) | {_y}
    _CONTRAST[_y] = _CONTRAST.get(_y, frozenset()) | {_x}

# The kind of answer a question asks for; "how many" wants a number, "why" a reason.
_WH_CLASS = {"why": "why", "when": "when", "where": "where", "who": "who", "whom": "who", "whose": "who"}
_HOW_CLASS = frozenset("many much long often far old big tall fast".split())
_AUX = frozenset("do does did is are was were can could will would should shall may might has have had am".split())
_WH_START = frozenset("what which how why when where who whom whose".split())

_STOP = frozenset("""
a an the and or but if then else of at by for with about against between into through during to from
in out on off over under again further once here there all any both each few more most other some such
only own same so than too very s t can will just should now is am are was were be been being have has
had having do does did doing would could might must shall may i me my myself we our ours ourselves you
your yours yourself yourselves he him his himself she her hers herself it its itself they them their
theirs themselves what which who whom whose this that these those how why when where whats hows whys
im ive id youre youve youd hes shes were theyre theyve thats theres heres get got getting go going
really actually ever also anyone someone somebody anybody something anything one ones way ways thing
things please tell know let make like best good much many well need want
""".split())

# Words a paraphrase adds or drops without changing what is asked.
_FILLER = frozenset("""
particular specific exactly basically simply currently nowadays still even possible great top
tips methods method steps step guide advice suggestions suggest recommend recommended effective
effectively proper properly right correct correctly main important common different various
kind kinds type types sort sorts example examples people person
""".split())

# Function words that say who does what to whom; their order is checked with the content words'.
_DIRECTION = frozenset("from to by into than versus vs".split())

_SUFFIXES = (("ational", "ate"), ("ization", "ize"), ("isation", "ize"), ("ations", "ate"), ("ation", "ate"),
             ("nesses", ""), ("ness", ""), ("ments", ""), ("ment", ""), ("ingly", ""), ("ings", ""),
             ("ing", ""), ("edly", ""), ("ied", "y"), ("ies", "y"), ("ions", ""), ("ion", ""), ("ers", ""),
             ("er", ""), ("ed", ""), ("es", ""), ("s", ""), ("ly", ""))


@lru_cache(maxsize=16384)
def _stem(word: str) -> str:
    """A small suffix stripper: relate/related/relation -> relat, modelling/modeling -> model.

    Cruder than Porter's, but only used to ask "does the other side say this
    too?", where conflating two forms of one word is the point."""
    for suffix, repl in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)] + repl
            break
    if len(word) > 3 and word.endswith("e"):
        word = word[:-1]
    if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "aeiou":
        word = word[:-1]
    return word


def _number(token: str) -> str | None:
    low = token.lower()
    if any(c.isdigit() for c in low):
        return low.replace(",", "")
    return _NUMBER_WORDS.get(low)


def _is_entity(token: str, index: int) -> bool:
    """A name: capitalised mid-sentence, an acronym, or letters mixed with digits."""
    if any(c.isdigit() for c in token) and any(c.isalpha() for c in token):
        return True
    if not token[:1].isupper() or token == "I":
        return False
    if len(token) > 1 and (token.isupper() or any(c.isupper() for c in token[1:])):
        return True  # USA, SQL, iPhone, JavaScript
    # Only the first token is known to start a sentence (punctuation is dropped).
    return index > 0 and token.lower() not in _STOP


def _question_kind(words: tuple[str, ...]) -> tuple[frozenset[str], str]:
    """(specific question words, form): ({"why"}, "wh"), ({"how many"}, "wh"), (set(), "yes/no")."""
    kinds = {_WH_CLASS[w] for w in words if w in _WH_CLASS}
    kinds |= {"how " + nxt for w, nxt in zip(words, words[1:]) if w == "how" and nxt in _HOW_CLASS}
    form = "yes/no" if words and words[0] in _AUX else "wh" if words and words[0] in _WH_START else ""
    return frozenset(kinds), form


@dataclass(frozen=True)
class Parsed:
    words: tuple[str, ...]            # lower-cased tokens, apostrophes removed
    numbers: Counter[str]
    symbols: Counter[str]
    negations: int
    entities: frozenset[str]          # lower-cased names
    kind: tuple[frozenset[str], str]  # what sort of answer a question asks for
    content: tuple[str, ...]          # stems of content words, in order
    key: tuple[str, ...]              # content stems and numbers, in order (for word order)
    stems: frozenset[str] = field(default=frozenset())  # stems of every word


@lru_cache(maxsize=4096)
def parse(text: str) -> Parsed:
    tokens = _TOKEN.findall(text)
    words = tuple(t.lower().replace("'", "").replace("’", "") for t in tokens)
    return Parsed(
        words=words,
        numbers=Counter(n for n in map(_number, tokens) if n is not None),
        symbols=Counter(_SYMBOLS.findall(text)),
        negations=sum(1 for t, w in zip(tokens, words) if w in _NEGATORS or t.lower().endswith(("n't", "n’t"))),
        entities=frozenset(w for i, (t, w) in enumerate(zip(tokens, words)) if _is_entity(t, i)),
        kind=_question_kind(words),
        content=tuple(_stem(w) for w in words
                      if w not in _STOP and w not in _FILLER and w not in _NEGATORS and _number(w) is None),
        key=tuple(_number(t) or _stem(w) for t, w in zip(tokens, words)
                  if _number(t) is not None or w in _DIRECTION
                  or (w not in _STOP and w not in _FILLER and w not in _NEGATORS)),
        stems=frozenset(map(_stem, words)),
    )


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str | None = None


def _unmatched(a: Parsed, b: Parsed) -> int:
    """Content words of ``a`` the other side lacks; a word said twice must be there twice."""
    have = Counter(b.content)
    missing = 0
    for c in a.content:
        if have[c] > 0:
            have[c] -= 1
        elif c not in b.stems or c in b.content:
            missing += 1
    return missing


def _inversions(a: Parsed, b: Parsed) -> int:
    """Pairs of shared key words whose relative order differs (who-did-what-to-whom).

    The k-th occurrence of a word on one side is matched with its k-th
    occurrence on the other, so repeated words ("Ted is John's son" against
    "John is Ted's son") are compared too."""
    positions: dict[tuple[str, int], int] = {}
    seen: Counter[str] = Counter()
    for i, w in enumerate(b.key):
        positions[(w, seen[w])] = i
        seen[w] += 1
    seen.clear()
    seq = []
    for w in a.key:
        pos = positions.get((w, seen[w]))
        seen[w] += 1
        if pos is not None:
            seq.append(pos)
    return sum(1 for i in range(len(seq)) for j in range(i + 1, len(seq)) if seq[i] > seq[j])


def _kind_differs(a: Parsed, b: Parsed) -> bool:
    """A reason is not a place or a time; a yes/no question is not a wh-question."""
    (wh_a, form_a), (wh_b, form_b) = a.kind, b.kind
    return wh_a != wh_b or {form_a, form_b} == {"yes/no", "wh"}


def _missing_entity(a: Parsed, b: Parsed) -> bool:
    return any(e not in b.words and _stem(e) not in b.stems for e in a.entities)


class Verifier:
    """Accept or reject one (query, candidate) pair; see the module docstring.

    ``content_budget`` unmatched content words (both sides together) are
    tolerated when the similarity is at least ``budget_similarity``; below it,
    none are.
    """

    def __init__(self, content_budget: int = 0, budget_similarity: float = 0.98, *,
                 content_ratio: float = 0.0, question_kind: bool = True, word_order: bool = True) -> None:
        self.content_budget = content_budget
        self.content_ratio = content_ratio
        self.budget_similarity = budget_similarity
        self.question_kind = question_kind
        self.word_order = word_order

    def check(self, query: str, candidate: str, similarity: float) -> Verdict:
        if query == candidate:
            return Verdict(True)
        a, b = parse(query), parse(candidate)
        if a.negations != b.negations:
            return Verdict(False, "negation")
        if a.numbers != b.numbers:
            return Verdict(False, "number")
        if a.symbols != b.symbols:
            return Verdict(False, "symbol")
        words_a, words_b = set(a.words), set(b.words)
        if any(_CONTRAST.get(w, frozenset()) & (words_b - words_a) for w in words_a - words_b):
            return Verdict(False, "contrast")
        if _missing_entity(a, b) or _missing_entity(b, a):
            return Verdict(False, "entity")
        if self.question_kind and _kind_differs(a, b):
            return Verdict(False, "question_kind")
        budget = self.content_budget if similarity >= self.budget_similarity else 0
        budget = max(budget, int(self.content_ratio * (len(a.content) + len(b.content))))
        if _unmatched(a, b) + _unmatched(b, a) > budget:
            return Verdict(False, "content")
        if self.word_order and _inversions(a, b):
            return Verdict(False, "word_order")
        return Verdict(True)
