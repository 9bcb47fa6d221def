"""The base of every admin request body: unknown fields are an error, not ignored.

Its own module so that the admin routes and the tenant routes share it without
importing each other.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
