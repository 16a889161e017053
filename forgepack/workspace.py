"""The workspace: every stage reads and writes here, so a killed run resumes and a report can be made.

Layout of `.forgepack/<slug>/`:
    recipe.toml          the resolved recipe (CLI overrides applied)
    profile.json         model-level results of `forgepack profile` (see `forgepack.profile`)
    cards/<id>.json      one card per variant
    samples/<id>.safetensors   bounded real inputs and eager outputs per variant
    store.sqlite         the search store: every candidate, verdict, timing, cost
    kernels/             sources and compiled objects of candidates
    pack/                pack build directory
    report.html
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgepack import cards as cards_mod
from forgepack import recipe as recipe_mod
from forgepack.cards import Card
from forgepack.recipe import Recipe

ROOT_ENV = "FORGEPACK_HOME"  # where `.forgepack/` lives; default: the current directory


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def for_recipe(cls, recipe: Recipe, override: str | Path | None = None) -> Workspace:
        if override is not None:
            return cls(Path(override))
        base = Path(os.environ.get(ROOT_ENV, "."))
        return cls(base / ".forgepack" / recipe.slug)

    # paths
    @property
    def recipe_path(self) -> Path:
        return self.root / "recipe.toml"

    @property
    def profile_path(self) -> Path:
        return self.root / "profile.json"

    @property
    def cards_dir(self) -> Path:
        return self.root / "cards"

    @property
    def samples_dir(self) -> Path:
        return self.root / "samples"

    @property
    def store_path(self) -> Path:
        return self.root / "store.sqlite"

    @property
    def kernels_dir(self) -> Path:
        return self.root / "kernels"

    @property
    def pack_dir(self) -> Path:
        return self.root / "pack"

    def card_path(self, card_id: str) -> Path:
        return self.cards_dir / f"{card_id}.json"

    def sample_path(self, card_id: str) -> Path:
        return self.samples_dir / f"{card_id}.safetensors"

    def create(self) -> Workspace:
        for d in (self.root, self.cards_dir, self.samples_dir, self.kernels_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self

    # recipe
    def save_recipe(self, recipe: Recipe) -> None:
        self.create()
        recipe_mod.save(recipe, self.recipe_path)

    def load_recipe(self) -> Recipe:
        return recipe_mod.load(self.recipe_path)

    # cards
    def save_card(self, card: Card) -> None:
        self.cards_dir.mkdir(parents=True, exist_ok=True)
        cards_mod.save(card, self.card_path(card.id))

    def load_card(self, card_id: str) -> Card:
        return cards_mod.load(self.card_path(card_id))

    def load_cards(self) -> list[Card]:
        """All cards, largest share first (capture order when not profiled yet)."""
        found = [cards_mod.load(p) for p in sorted(self.cards_dir.glob("*.json"))]
        return sorted(found, key=lambda c: -(c.profile.share if c.profile else 0.0))

    # json documents
    def write_json(self, name: str, data: Any) -> Path:
        path = self.root / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        tmp.replace(path)  # atomic: a killed run never leaves half a file
        return path

    def read_json(self, name: str) -> Any:
        return json.loads((self.root / name).read_text())
