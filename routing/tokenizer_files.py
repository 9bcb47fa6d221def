"""A model's tokenizer files, fetched into a directory for ``routing.tokenizers`` (``kvgate tokenizer``).

Precise routing needs the token ids vLLM will prefill, so kvgate loads what the
replicas load to render and tokenize a prompt: the tokenizer, its chat template,
the model's config. It never needs the weights, so a deployment fetches only
these files: from the Hugging Face Hub in an init step (deploy/k8s, the compose
``gpu`` profile), or copied from a volume that already holds the model (an
air-gapped cluster). A fetch that fails must not keep kvgate from starting: it
then routes that model approximately and ``/readyz`` says so (``--optional``).
"""

from __future__ import annotations

import os
import shutil
from fnmatch import fnmatch
from pathlib import Path

__all__ = ["PATTERNS", "FetchError", "wanted", "fetch", "describe"]

# What transformers' AutoTokenizer and vLLM's renderer read from a model directory,
# for the tokenizer families vLLM serves (fast tokenizers, sentencepiece, tiktoken), and
# nothing else: a 7B model's directory is 15 GB, these files a few MB.
PATTERNS = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja",
    "config.json", "generation_config.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "*.tiktoken",
)


class FetchError(Exception):
    """Why the files could not be had (one line, fit for a log)."""


def wanted(relative: str) -> bool:
    """Whether a file of a model directory (its path relative to it, with ``/``) is a tokenizer file."""
    return any(fnmatch(relative, p) for p in PATTERNS)


def _listed(root: Path) -> list[str]:
    """The tokenizer files under ``root``, as relative paths."""
    return sorted(rel for p in root.rglob("*") if p.is_file() and wanted(rel := p.relative_to(root).as_posix()))


def fetch(source: str, dest: str | Path, revision: str | None = None) -> list[str]:
    """Put ``source``'s tokenizer files in ``dest``; returns their relative paths.

    ``source``: a model directory (copied from; it wins over a Hub id of the same
    name, as transformers' own loaders decide) or a Hub model id (downloaded;
    ``HF_TOKEN`` for a gated model)."""
    out = Path(dest)
    local = Path(source)
    if local.is_dir():
        names = _listed(local)
        if not names:
            raise FetchError(f"{source}: no tokenizer files in this directory")
        for name in names:
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            shutil.copyfile(local / name, tmp)
            tmp.replace(target)  # atomic: a kvgate reading the directory never sees half a file
        return names
    if source.startswith(("/", ".", "~")):
        raise FetchError(f"{source}: no such directory")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        # kvgate's image sets it, so that nothing downloads at serving time.
        raise FetchError(f"{source}: HF_HUB_OFFLINE is set; set HF_HUB_OFFLINE=0 for this command "
                         "or give a directory that holds the model")
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id=source, revision=revision, allow_patterns=list(PATTERNS), local_dir=str(out))
    except Exception as e:  # the Hub's errors name the repo, never the token
        raise FetchError(f"{source}: download failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    names = _listed(out)
    if not names:
        raise FetchError(f"{source}: the repository has no tokenizer files")
    return names


def describe(dest: str | Path) -> str:
    """Load the directory as kvgate will (``routing.tokens.HFTokenSource``) and render a chat with
    it: what it found, or ``FetchError``."""
    from .tokens import HFTokenSource

    try:
        source = HFTokenSource(dest)
    except Exception as e:
        raise FetchError(f"{dest}: the files do not load as a tokenizer ({type(e).__name__}: {e})"[:300]) from e
    try:
        if not source.chat_template:
            return f"vocabulary {len(source.tokenizer)}, no chat template (chat requests will route approximately)"
        try:
            ids = source._chat_ids({"messages": [{"role": "system", "content": "You are kvgate's probe."},
                                                 {"role": "user", "content": "Hello"}]})
        except Exception as e:
            raise FetchError(f"{dest}: the chat template does not render ({type(e).__name__}: {e})"[:300]) from e
        return f"vocabulary {len(source.tokenizer)}, chat template renders (a two-message chat is {len(ids)} tokens)"
    finally:
        source.close()
