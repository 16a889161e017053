"""Every LLM exchange of a build, recorded with it, and replayed offline.

A build with an LLM proposer writes ``<workspace>/cassette/``: ``exchanges.jsonl``, one line per call in
the order the store records them (the request as sent, without the key; the reply as received; the
attempts and seconds it took), and ``blobs/<sha256>.txt``, every long text of those requests stored
once by content (the static ABI block, identical in every call, is one file). A line is written before
its call's row in the store, so a killed build never has a call without its exchange.

``FORGEPACK_LLM_REPLAY=DIR`` (a cassette, or the workspace that holds one) makes the search take each
reply from DIR instead of the network: no key, no server, no cost beyond what the recording's tokens
are priced at. An exchange is found by what the search knows before asking: the card, the parent's
source hash ("" from scratch) and how many calls from that parent came before (its ``occurrence``).
The prompt itself is not compared (it holds measured timings, which differ between runs); a call the
recording never made (another verdict led the search elsewhere) stops the build with the point where
the two diverged. A replayed build records its own cassette too.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forgepack.errors import ForgepackError

REPLAY_ENV = "FORGEPACK_LLM_REPLAY"
DIRNAME = "cassette"
EXCHANGES = "exchanges.jsonl"
BLOBS = "blobs"
BLOB_MIN_CHARS = 2048  # texts this long are stored once by content (the static block, the prompts)


@dataclass(frozen=True)
class Exchange:
    card_id: str
    parent_hash: str  # the parent candidate's source hash; "" for a kernel from scratch
    occurrence: int  # calls to this card from this parent before this one
    proposer: str
    model: str | None
    request: dict
    reply: dict
    attempts: int = 1
    seconds: float = 0.0

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.card_id, self.parent_hash, self.occurrence)


def replay_dir() -> Path | None:
    """The cassette `FORGEPACK_LLM_REPLAY` names, if it is set (a workspace names its own cassette)."""
    value = os.environ.get(REPLAY_ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    return path / DIRNAME if (path / DIRNAME / EXCHANGES).is_file() else path


class Cassette:
    """A workspace's record of its LLM exchanges (append only)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @classmethod
    def of_workspace(cls, workspace_root: str | Path) -> Cassette:
        return cls(Path(workspace_root) / DIRNAME)

    def record(self, exchange: Exchange) -> None:
        (self.root / BLOBS).mkdir(parents=True, exist_ok=True)
        data = asdict(exchange)
        data["request"] = self._stored(exchange.request)
        with open(self.root / EXCHANGES, "a", encoding="utf-8") as out:
            out.write(json.dumps(data, sort_keys=True) + "\n")
            out.flush()

    def _stored(self, value: Any) -> Any:
        """`value` with every long string replaced by a reference to its blob (written first)."""
        if isinstance(value, str) and len(value) >= BLOB_MIN_CHARS:
            digest = hashlib.sha256(value.encode()).hexdigest()
            path = self.root / BLOBS / f"{digest}.txt"
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                tmp.write_text(value, encoding="utf-8")
                tmp.replace(path)
            return {"$blob": digest}
        if isinstance(value, dict):
            return {k: self._stored(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._stored(v) for v in value]
        return value

    def exchanges(self) -> list[Exchange]:
        """Every complete exchange, in recorded order (a line cut short by a killed build is left out)."""
        path = self.root / EXCHANGES
        if not path.is_file():
            return []
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            data["request"] = self._loaded(data["request"])
            out.append(Exchange(**data))
        return out

    def _loaded(self, value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"$blob"}:
                path = self.root / BLOBS / f"{value['$blob']}.txt"
                if not path.is_file():
                    raise ForgepackError(f"the cassette {self.root} lacks {path.name} (a blob its exchanges name)")
                return path.read_text(encoding="utf-8")
            return {k: self._loaded(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._loaded(v) for v in value]
        return value


class Replay:
    """Replies from a recorded cassette, by (card, parent source hash, occurrence).

    Where the recording holds the same key twice (a build killed after writing an exchange and before
    storing its call, then resumed), the later one is the one its store kept.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        exchanges = Cassette(self.root).exchanges()
        if not exchanges:
            raise ForgepackError(f"{REPLAY_ENV}={self.root}: no recorded exchanges there "
                                 f"(expected {DIRNAME}/{EXCHANGES} in a workspace, or {EXCHANGES} in the directory)")
        self.by_key = {e.key: e for e in exchanges}
        self.replayed = 0

    def reply(self, card_id: str, parent_hash: str, occurrence: int, proposer: str) -> Exchange:
        found = self.by_key.get((card_id, parent_hash, occurrence))
        if found is None:
            start = f"from the parent with source {parent_hash[:12]}" if parent_hash else "from scratch"
            raise ForgepackError(
                f"{REPLAY_ENV}={self.root}: the recording has no call {occurrence + 1} to {card_id} {start}; this "
                f"build left the recorded path here (a verdict or a setting differed). Unset {REPLAY_ENV} to ask "
                "the model instead")
        if found.proposer != proposer:
            raise ForgepackError(f"{REPLAY_ENV}={self.root}: its exchanges are the {found.proposer} proposer's, "
                                 f"this build uses {proposer} (--proposer {found.proposer})")
        self.replayed += 1
        return found
