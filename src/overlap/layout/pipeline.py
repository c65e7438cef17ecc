"""Which layers each pipeline stage holds: the one resolution that model build, schedules,
planner and memory estimate all read.

Megatron-Core has four ways to say it, and each becomes the same thing here, a list of virtual
stages in layer order (virtual stage v = chunk x PP + pp_rank, so rank r holds v = r, r + PP, r +
2 PP, ...), each a list of symbols: `E` the embedding, `t` a transformer (decoder) layer, `m` a
multi-token-prediction layer, `L` the loss (final norm, output layer and cross-entropy):

- `pipeline_model_parallel_layout`: the stages spelt out, as a string (`"Et*3|(tt|)*29,m|L"`: `|`
  ends a stage, `x*N` and `(...)*N` repeat, commas are cosmetic) or a list of lists of layer
  names (`[["embedding", "decoder"], ["decoder", "loss"]]`). Its stage count fixes VPP (= stages
  / PP).
- `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`: those ranks get
  that many layers, the middle ranks an even split of the rest; each rank's layers divide evenly
  over its VPP chunks.
- `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split`: the embedding
  (loss) counts as one layer when the layers are divided evenly, so the first (last) virtual
  stage builds one transformer layer fewer.
- none of them: num_layers / PP per rank, / VPP per chunk.

The rules are Megatron-Core's (`TransformerConfig.__post_init__`, `PipelineParallelLayerLayout`),
and an impossible split is a ConfigError naming the field, the value and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from overlap.errors import ConfigError

EMBEDDING, DECODER, MTP, LOSS = "E", "t", "m", "L"
LAYOUT_FIELD = "model.pipeline_model_parallel_layout"
# The list form's layer names (Megatron's LayerType members) and the string form's letters
_NAMES = {"embedding": EMBEDDING, "decoder": DECODER, "mtp": MTP, "loss": LOSS}
_LETTERS = frozenset(_NAMES.values())
_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_SINGLE = re.compile(r"(.)\*(\d+)")


@dataclass(frozen=True)
class StageLayers:
    """One virtual pipeline stage (= one model chunk of one rank): transformer layers [start,
    end) under their global numbers, whether it embeds the tokens first / ends with the loss, and
    its MTP layers."""

    pp_rank: int
    chunk: int
    start: int
    end: int
    embedding: bool = False
    loss: bool = False
    mtp: int = 0

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def symbols(self) -> str:
        return (
            (EMBEDDING if self.embedding else "")
            + DECODER * self.num_layers
            + MTP * self.mtp
            + (LOSS if self.loss else "")
        )


@dataclass(frozen=True)
class PipelineLayout:
    """Every virtual stage of a run, in layer order (`stages[chunk * pp + pp_rank]`), and how it
    was decided."""

    pp: int
    vpp: int
    stages: tuple[StageLayers, ...]
    # which field decided it: "even split", the first/last stage sizes, "account_for_*", the layout
    source: str

    def stage(self, pp_rank: int, chunk: int) -> StageLayers:
        return self.stages[chunk * self.pp + pp_rank]

    def rank_stages(self, pp_rank: int) -> list[StageLayers]:
        """The model chunks of pipeline rank `pp_rank`, chunk 0 first."""
        return [self.stage(pp_rank, c) for c in range(self.vpp)]

    def layers_per_rank(self) -> list[int]:
        """Transformer layers each pipeline rank holds (all its chunks)."""
        return [sum(s.num_layers for s in self.rank_stages(r)) for r in range(self.pp)]

    def busiest_rank_layers(self) -> list[int]:
        """The global transformer-layer numbers of the pipeline rank holding the most (all its
        chunks): the rank the memory estimate and the planner's per-stage layer counts size for."""
        held = [
            [i for s in self.rank_stages(r) for i in range(s.start, s.end)] for r in range(self.pp)
        ]
        return max(held, key=len)

    def as_string(self) -> str:
        """The layout in Megatron's string grammar, runs of equal stages folded
        (`"Ett|(ttt|)*30ttL"`)."""
        parts = [_fold(s.symbols) for s in self.stages]
        out: list[str] = []
        i = 0
        # the last stage holds the loss, so no run of equal stages includes it
        while i < len(parts):
            n = 1
            while i + n < len(parts) and parts[i + n] == parts[i]:
                n += 1
            last = i + n == len(parts)
            folded = f"({parts[i]}|)*{n}"
            if n > 1 and len(folded) < n * (len(parts[i]) + 1):
                out.append(folded)
            else:
                out.append("|".join(parts[i : i + n]) + ("" if last else "|"))
            i += n
        return "".join(out)

    def table(self) -> list[str]:
        """What each pipeline rank holds, chunk by chunk, equal neighbouring ranks on one line (as
        Megatron-Core prints a parsed layout): `PP rank 1-6   t*3 | t*3 | t*3 | t*3`."""
        rows = [
            " | ".join(_fold(s.symbols) or "(empty)" for s in self.rank_stages(r))
            for r in range(self.pp)
        ]
        out, first = [], 0
        for r in range(1, self.pp + 1):
            if r == self.pp or rows[r] != rows[first]:
                ranks = f"{first}" if r - 1 == first else f"{first}-{r - 1}"
                out.append(f"PP rank {ranks:<7} {rows[first]}")
                first = r
        return out

    def describe(self) -> str:
        """One line for people: who decided it, PP x VPP, and the transformer layers per rank."""
        per_rank = self.layers_per_rank()
        spread = (
            f"{min(per_rank)}-{max(per_rank)}"
            if min(per_rank) != max(per_rank)
            else f"{per_rank[0]}"
        )
        return (
            f"from {self.source}: PP {self.pp} x VPP {self.vpp}, {spread} transformer layers "
            "per rank"
        )


def _fold(symbols: str) -> str:
    """`"Etttt"` -> `"Et*4"`: runs of three or more equal letters as `x*N`."""
    return re.sub(r"(.)\1{2,}", lambda run: f"{run.group(1)}*{len(run.group(0))}", symbols)


# More symbols than any model has layers: the bound on a layout's expanded length, checked before
# a repetition is expanded (`t*9999999999` would otherwise fill the memory).
MAX_SYMBOLS = 1_000_000


def _expand_repeats(pattern: re.Pattern, text: str, spec: str) -> str:
    """`text` with every repetition `pattern` matches written out, refused before anything is built
    if the result would exceed MAX_SYMBOLS."""
    size = len(text)
    for m in pattern.finditer(text):
        size += len(m.group(1)) * int(m.group(2)) - len(m.group(0))
        if size > MAX_SYMBOLS:
            raise ConfigError(
                LAYOUT_FIELD,
                spec,
                f"its repetitions expand to more than {MAX_SYMBOLS:,} symbols "
                f"({m.group(0)!r} alone is {len(m.group(1)) * int(m.group(2)):,}); a layout "
                "names each of the model's layers once.",
                "give counts that add up to model.num_layers (e.g. 'Et*3|t*4|t*4|t*3L').",
            )
    return pattern.sub(lambda g: g.group(1) * int(g.group(2)), text)


def parse_layout(spec: str | list, pp: int) -> list[str]:
    """A layout in either of Megatron's forms -> one string of symbols per virtual stage (no
    checks against the model: `resolve_pipeline_layout` makes those)."""
    if isinstance(spec, str):
        text = spec.replace(",", "").replace(" ", "")
        if not text:
            raise ConfigError(
                LAYOUT_FIELD,
                spec,
                "an empty layout.",
                "spell out the stages, e.g. 'Et*3|t*4|t*4|t*3L', or set it to null.",
            )
        text = _expand_repeats(_SINGLE, _expand_repeats(_GROUP, text, spec), spec)
        stages = text.split("|")
        bad = sorted({c for c in text if c not in _LETTERS and c != "|"})
        if bad:
            raise ConfigError(
                LAYOUT_FIELD,
                spec,
                f"unknown symbol(s) {bad} (after expanding repetitions: a '*' must "
                "follow one letter or a parenthesised group and be followed by a count).",
                "use E (embedding), t (transformer layer), m (MTP layer), L (loss), '|' between "
                "stages, x*N and (...)*N for repeats.",
            )
    elif isinstance(spec, (list, tuple)) and all(isinstance(row, (list, tuple)) for row in spec):
        stages = []
        for row in spec:
            names = [str(x).strip().lower() for x in row]
            unknown = [x for x in names if x not in _NAMES]
            if unknown:
                raise ConfigError(
                    LAYOUT_FIELD,
                    spec,
                    f"unknown layer name(s) {unknown} in the list form.",
                    f"use {sorted(_NAMES)} (or the string form 'E', 't', 'm', 'L').",
                )
            stages.append("".join(_NAMES[x] for x in names))
    else:
        raise ConfigError(
            LAYOUT_FIELD,
            spec,
            "a layout is a string or a list of lists of layer names.",
            "write e.g. 'Et*3|t*4|t*4|t*3L' or [[embedding, decoder], [decoder, loss]].",
        )
    if len(stages) % pp:
        raise ConfigError(
            LAYOUT_FIELD,
            spec,
            f"it has {len(stages)} stage(s), not a multiple of pipeline_model_parallel_size "
            f"({pp}); "
            "stages = PP x VPP.",
            f"give PP x VPP stages separated by '|' (e.g. {pp} or {2 * pp}), or change -pp.",
        )
    return stages


MAX_LAYERS = 100_000


def resolve_pipeline_layout(model: Any, pp: int) -> PipelineLayout:
    """The pipeline layout `model` (a ModelConfig) asks for on `pp` pipeline ranks; a ConfigError
    if it cannot be."""
    n, vpp = model.num_layers, model.virtual_pipeline_model_parallel_size
    # the stages are spelt out layer by layer (Megatron's layout form): bounded before that (and
    # checked here, since the layout is resolved before the architecture's own rules run)
    for field, count, fix in (
        (
            "model.num_layers",
            n,
            "give the model's real depth (the largest published ones have about 100-130).",
        ),
        (
            "model.mtp_num_layers",
            model.mtp_num_layers or 0,
            "give the real count (DeepSeek-V3 predicts one more token: 1), or null.",
        ),
    ):
        if count < 0:
            raise ConfigError(field, count, "a layer count must be >= 0.", fix)
        if count > MAX_LAYERS:
            raise ConfigError(
                field,
                count,
                f"more than {MAX_LAYERS:,} layers; no model is that deep, and its layout is "
                "written out layer by layer.",
                fix,
            )
    first, last = model.num_layers_in_first_pipeline_stage, model.num_layers_in_last_pipeline_stage
    embed, loss = (
        model.account_for_embedding_in_pipeline_split,
        model.account_for_loss_in_pipeline_split,
    )
    spec = model.pipeline_model_parallel_layout
    if spec is not None:
        others = {
            "num_layers_in_first_pipeline_stage": first,
            "num_layers_in_last_pipeline_stage": last,
            "account_for_embedding_in_pipeline_split": embed or None,
            "account_for_loss_in_pipeline_split": loss or None,
        }
        clash = [k for k, v in others.items() if v is not None]
        if clash:
            raise ConfigError(
                LAYOUT_FIELD,
                spec,
                f"a layout spells out every stage, so it cannot be combined with "
                f"{', '.join('model.' + k for k in clash)}.",
                "drop those fields, or drop the layout.",
            )
        stages = parse_layout(spec, pp)
        found = len(stages) // pp
        if vpp is not None and vpp != found:
            raise ConfigError(
                "model.virtual_pipeline_model_parallel_size",
                vpp,
                f"the layout has {len(stages)} stages = PP {pp} x VPP {found}.",
                f"use -vp {found if found > 1 else 'None'} (or leave it unset: the layout "
                "decides it).",
            )
        return _checked(stages, pp, n, model.mtp_num_layers, "pipeline_model_parallel_layout", spec)
    vpp = vpp or 1
    if (first is not None or last is not None) and (embed or loss):
        raise ConfigError(
            (
                "model.account_for_embedding_in_pipeline_split"
                if embed
                else "model.account_for_loss_in_pipeline_split"
            ),
            True,
            "it cannot be combined with num_layers_in_first/last_pipeline_stage (Megatron-Core's "
            "rule: both decide the first and last stages' sizes).",
            "use one of the two ways, or a pipeline_model_parallel_layout.",
        )
    if first is not None or last is not None:
        per_rank = _first_last_split(n, pp, vpp, first, last)
        source = "num_layers_in_first/last_pipeline_stage"
    else:
        total = n + bool(embed) + bool(loss)
        if total % pp or total // pp % vpp:
            field, value = (
                ("model.num_layers", n)
                if total % pp
                else ("model.virtual_pipeline_model_parallel_size", vpp)
            )
            counted = " + 1 (embedding)" * bool(embed) + " + 1 (loss)" * bool(loss)
            layers = f"{n}{counted} = {total} layers" if counted else f"{n} layers"
            why = (
                f"{layers} do not split evenly over PP {pp} pipeline stages."
                if total % pp
                else f"{layers} make {total // pp} layers per pipeline stage, which do not split "
                f"into VPP {vpp} equal virtual-pipeline chunks."
            )
            raise ConfigError(
                field,
                value,
                why,
                "choose -pp/-vp that divide it, set num_layers_in_first/last_pipeline_stage or "
                "account_for_embedding/loss_in_pipeline_split, or spell the stages out with "
                "pipeline_model_parallel_layout.",
            )
        per_rank = [total // pp] * pp
        source = "account_for_embedding/loss_in_pipeline_split" if embed or loss else "even split"
    per_chunk = [per_rank[r] // vpp for r in range(pp)]
    stages = []
    for v in range(pp * vpp):
        count = per_chunk[v % pp]
        head = EMBEDDING if v == 0 else ""
        tail = LOSS if v == pp * vpp - 1 else ""
        # the embedding / loss takes a layer's place (every chunk holds >= 1 here, the only chunk >=
        # 2 + n)
        count -= (bool(embed) and v == 0) + (bool(loss) and v == pp * vpp - 1)
        stages.append(head + DECODER * count + tail)
    if model.mtp_num_layers:
        # with the loss, as Megatron places it
        stages[-1] = stages[-1][:-1] + MTP * model.mtp_num_layers + LOSS
    return _checked(stages, pp, n, model.mtp_num_layers, source, None)


def _first_last_split(n: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per pipeline rank with an uneven first and/or last rank (Megatron-Core's rules)."""
    if pp == 1:
        raise ConfigError(
            "model.num_layers_in_first_pipeline_stage",
            first if first is not None else last,
            "uneven first/last pipeline stages need pipeline parallelism.",
            "use -pp 2 or more, or drop num_layers_in_first_pipeline_stage / "
            "num_layers_in_last_pipeline_stage.",
        )
    for name, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            raise ConfigError(
                f"model.num_layers_in_{name}_pipeline_stage",
                value,
                "a stage holds at least one layer.",
                "use 1 or more, or null for an even split.",
            )
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = n - (first or 0) - (last or 0)
    if (
        middle_layers < 0
        or (middle_stages == 0 and middle_layers != 0)
        or (middle_stages and (middle_layers < middle_stages or middle_layers % middle_stages))
    ):
        raise ConfigError(
            "model.num_layers",
            n,
            f"{middle_layers} layers do not split evenly over the {middle_stages} pipeline "
            f"stage(s) left after num_layers_in_first_pipeline_stage={first} and "
            f"num_layers_in_last_pipeline_stage={last} (PP={pp}).",
            "choose -pp, num_layers and the first/last stage sizes so that the rest divides "
            "evenly.",
        )
    per_rank = [middle_layers // middle_stages if middle_stages else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    for rank, count in enumerate(per_rank):
        if count % vpp:
            raise ConfigError(
                "model.virtual_pipeline_model_parallel_size",
                vpp,
                f"pipeline stage {rank} has {count} layers, which do not split into {vpp} equal "
                "virtual-pipeline chunks.",
                "choose -pp/-vp (and the first/last stage sizes) so that every stage's layer count "
                "is a multiple of VPP, or spell the stages out with "
                "pipeline_model_parallel_layout.",
            )
    return per_rank


def _checked(
    stages: list[str], pp: int, n: int, mtp: int | None, source: str, spec: Any
) -> PipelineLayout:
    """Symbols per virtual stage -> a PipelineLayout, after the rules every layout obeys."""
    field, shown = (LAYOUT_FIELD, spec) if spec is not None else ("model.num_layers", n)
    flat = "".join(stages)
    if flat.count(EMBEDDING) != 1 or flat.count(LOSS) != 1:
        raise ConfigError(
            field,
            shown,
            "the embedding (E) and the loss (L) appear exactly once each.",
            "write one E at the start of the first stage and one L at the end of the last.",
        )
    if not stages[0].startswith(EMBEDDING) or not stages[-1].endswith(LOSS):
        raise ConfigError(
            field,
            shown,
            "the embedding (E) opens the first stage and the loss (L) closes the last (the first "
            "virtual stage reads the tokens, the last one computes the loss).",
            "move E to the front of the first stage and L to the end of the last.",
        )
    if flat.count(DECODER) != n:
        raise ConfigError(
            field,
            shown,
            f"it places {flat.count(DECODER)} transformer layers (t), but model.num_layers is {n}.",
            f"give exactly {n} t's, or change model.num_layers.",
        )
    if flat.count(MTP) != (mtp or 0):
        raise ConfigError(
            field,
            shown,
            f"it places {flat.count(MTP)} MTP layer(s) (m), but model.mtp_num_layers is {mtp}.",
            "make the m's match model.mtp_num_layers.",
        )
    if MTP in flat and DECODER in flat[flat.index(MTP) :]:
        raise ConfigError(
            field,
            shown,
            "MTP layers (m) follow every transformer layer (t).",
            "move the m's after the last t.",
        )
    vpp = len(stages) // pp
    out, start = [], 0
    for v, symbols in enumerate(stages):
        count = symbols.count(DECODER)
        body = symbols.strip(EMBEDDING + LOSS)
        if body != DECODER * count + MTP * symbols.count(MTP):
            raise ConfigError(
                field,
                shown,
                f"stage {v} ('{symbols}') mixes its layers out of order.",
                "write a stage as [E] t... [m...] [L].",
            )
        out.append(
            StageLayers(
                pp_rank=v % pp,
                chunk=v // pp,
                start=start,
                end=start + count,
                embedding=EMBEDDING in symbols,
                loss=LOSS in symbols,
                mtp=symbols.count(MTP),
            )
        )
        start += count
    return PipelineLayout(pp=pp, vpp=vpp, stages=tuple(out), source=source)
