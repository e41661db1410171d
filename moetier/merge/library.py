"""A model's library of merged variants (CoMoE §III-B 4): the original and merged stores side by side, each with its
expert bytes and its measured quality — what Eq. 34 chooses from (the best quality that fits the memory now free).

    FOLDER/library.json        {"format": "moetier-merge-library", "version": 1, "original": PATH,
                                "variants": [{"name", "path", "expert_bytes", "kept", "quality"}, ...]}
    FOLDER/<name>/             each merged variant's store

The paper's six (§III-B 4): fixed ratios 0.75/0.5/0.25 (light, medium, heavy) and adaptive (r_base, Δr) = (0.6,
0.3), (0.4, 0.2), (0.2, 0.1). Quality is `moetier eval`'s on held-out text, each variant scored against the
original's own log-probabilities (perplexity per text, top-1 agreement, KL)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moetier.atomic import atomic_write_json
from moetier.errors import MoetierError
from moetier.merge.plan import ADAPTIVE, FIXED, AdaptiveRatio, FixedRatio, Retention

FORMAT, VERSION, FILE = "moetier-merge-library", 1, "library.json"


def paper_variants(min_experts: int = 1) -> dict[str, Retention]:
    """The paper's six, by name."""
    out: dict[str, Retention] = {f"fixed-{n}": FixedRatio(r) for n, r in FIXED.items()}
    out.update({f"adaptive-{n}": AdaptiveRatio(b, d, min_experts, n) for n, (b, d) in ADAPTIVE.items()})
    return out


@dataclass(frozen=True)
class Variant:
    name: str  # "original" for the model itself
    path: str
    expert_bytes: int
    kept: tuple[int, ...]  # experts per MoE layer
    quality: dict = field(default_factory=dict)  # perplexity per text, perplexity_change, top1_agreement, kl

    def __post_init__(self) -> None:
        if not self.name or self.expert_bytes <= 0 or not self.kept:
            raise ValueError("a variant needs a name, its bytes and its experts per layer")


@dataclass(frozen=True)
class Library:
    original: str
    variants: tuple[Variant, ...]  # the original first

    def save(self, folder: Path | str) -> Path:
        path = Path(folder) / FILE
        atomic_write_json(path, {"format": FORMAT, "version": VERSION, "original": self.original,
                                 "variants": [asdict(v) for v in self.variants]})
        return path

    @classmethod
    def load(cls, folder: Path | str) -> Library:
        path = Path(folder) / FILE
        try:
            d = json.loads(path.read_text())
            if d.get("format") != FORMAT or d.get("version") != VERSION:
                raise ValueError(f"not a version {VERSION} {FORMAT}")
            variants = tuple(Variant(v["name"], v["path"], int(v["expert_bytes"]), tuple(v["kept"]),
                                     dict(v.get("quality") or {})) for v in d["variants"])
            return cls(str(d["original"]), variants)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MoetierError(f"cannot read the merge library {path}: {e}",
                               hint="build it with `moetier merge --library`") from None
