"""Predicted vs paper for FlexGen's Table 2 (the "FlexGen" row, no compression) on the paper's T4 machine.

``python -m localgen.policy.table2 [--profile flexgen_t4] [--tiers any|fewest]`` runs the policy search
for OPT-6.7B, 30B and 175B at prompt 512 and 1024, gen 32, and prints a Markdown table per ``tiers``
(default both: the fastest policy over every tier, and the paper's tuning rule, fewest tiers first):
predicted tokens/s, the paper's, their ratio, the chosen policy, the paper's policy and what the cost
model predicts for it.

Paper numbers (Sheng et al., FlexGen, ICML 2023, arXiv 2303.06865):
- throughput: Table 2; the prompt-512 row is repeated in FlexGen's benchmark/batch_size_table.md;
- policies: Tables 15 (prompt 512) and 16 (prompt 1024) of the appendix, "(gbs x num_gpu_batches,
  wg, wc, cg, cc, hg, hc)" in FlexGen's ``--percent`` convention; the same commands are in
  benchmark/flexgen/bench_suite.py (suite_6b7_1x1, suite_30b_1x1, suite_175b_1x1), and §6.1 / Table 4
  restate OPT-30B's 48 x 3 with 20% of the weights on the GPU and OPT-175B's 32 x 8.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from localgen.policy.cost_model import CostModel, Prediction, Workload
from localgen.policy.policy import Policy
from localgen.policy.presets import preset_config
from localgen.policy.search import NoFeasiblePolicyError, SearchResult, search
from localgen.profiler.hardware import HardwareProfile, load_profile

GEN_LEN = 32


@dataclass(frozen=True)
class PaperCell:
    """One cell of Table 2 with its policy: tokens/s, GPU batch, GPU batches, FlexGen ``--percent``
    (wg wc cg cc hg hc, nominal percents; disk takes the rest of each group)."""

    throughput: float
    gbs: int
    num_gpu_batches: int
    percent: tuple[int, int, int, int, int, int]


PAPER_TABLE2: dict[tuple[str, int], PaperCell] = {
    ("opt-6.7b", 512): PaperCell(25.26, 2, 1, (100, 0, 100, 0, 100, 0)),
    ("opt-30b", 512): PaperCell(7.32, 48, 3, (20, 80, 0, 100, 0, 100)),
    ("opt-175b", 512): PaperCell(0.69, 32, 8, (0, 50, 0, 0, 0, 100)),
    ("opt-6.7b", 1024): PaperCell(13.72, 1, 1, (100, 0, 100, 0, 100, 0)),
    ("opt-30b", 1024): PaperCell(3.50, 20, 4, (4, 96, 0, 100, 0, 100)),
    ("opt-175b", 1024): PaperCell(0.35, 12, 12, (0, 50, 0, 0, 0, 100)),
}


def flexgen_weight_placement(cm: CostModel, wg: float, wc: float) -> tuple[float, float, float]:
    """Shares of a layer's weight bytes on (GPU, CPU, disk) when FlexGen's runtime is given the
    nominal fractions ``wg``, ``wc`` (disk: the rest).

    FlexGen flexgen/flex_opt.py ``init_weight_list``: in each sublayer, tensor i goes to the tier in
    whose cumulative range [disk, CPU, GPU] the midpoint of its cumulative size falls (``get_choice``);
    biases and layer norms are ignored here. E.g. OPT's nominal 20% GPU puts only attention's w_out
    there: 1/12 of the bytes.
    """
    subs = cm._sublayer_matrices()
    total = float(sum(map(sum, subs)))
    out = [0.0, 0.0, 0.0]
    for mats in subs:
        cum, size = 0.0, float(sum(mats))
        for m in mats:
            mid = (cum + m / 2) / size
            cum += m
            tier = 2 if mid < 1 - wg - wc else 1 if mid < 1 - wg else 0
            out[tier] += m / total
    return out[0], out[1], out[2]


def paper_policy(cm: CostModel, cell: PaperCell) -> Policy:
    """The paper's policy with weights as FlexGen's runtime realizes them, CPU attention on when the
    cache is off the GPU (the paper runs those with ``--cpu``)."""
    wg, wc, cg, cc, hg, hc = (p / 100 for p in cell.percent)
    g, c, d = flexgen_weight_placement(cm, wg, wc)
    return Policy(gbs=cell.gbs, num_gpu_batches=cell.num_gpu_batches, wg=g, wc=c, wd=d, cg=cg, cc=cc,
                  cd=1 - cg - cc, hg=hg, hc=hc, hd=1 - hg - hc, cpu_cache_compute=cg < 1).validate()


@dataclass
class Row:
    """One cell: the search's result, the paper's cell, and the cost model on the paper's policy."""

    model: str
    prompt_len: int
    result: SearchResult | None  # None: nothing fits this machine
    paper: PaperCell
    paper_policy: Policy  # as FlexGen's runtime realizes it (``paper_policy``)
    paper_prediction: Prediction  # the cost model on it

    @property
    def ratio(self) -> float:
        return (self.result.throughput if self.result else 0.0) / self.paper.throughput


def rows(hw: HardwareProfile | None = None, tiers: str = "any") -> list[Row]:
    """Search every cell of ``PAPER_TABLE2`` on ``hw`` (default: the shipped ``flexgen_t4``) with the
    search's ``tiers`` ("fewest": the paper's tuning rule)."""
    hw = hw or load_profile("flexgen_t4")
    out = []
    for (model, s), cell in sorted(PAPER_TABLE2.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cfg, wl = preset_config(model), Workload(s, GEN_LEN)
        cm = CostModel(cfg, hw, wl)
        pol = paper_policy(cm, cell)
        try:
            res = search(cfg, hw, wl, tiers=tiers)
        except NoFeasiblePolicyError:
            res = None
        out.append(Row(model, s, res, cell, pol, cm.predict(pol)))
    return out


def _pct(p: Policy) -> str:
    f = p.fractions()
    return " ; ".join("/".join(f"{100 * v:.0f}" for v in f[i:i + 3]) for i in (0, 3, 6))


def markdown(table: list[Row]) -> str:
    """The table: policies as ``gbs x nb``, then weights ; cache ; activations in percent GPU/CPU/disk."""
    head = ("| model | prompt | predicted tok/s | paper tok/s | ratio | chosen policy: gbs x nb; w ; c ; h "
            "(% GPU/CPU/disk) | paper policy (weights as realized) | predicted for the paper policy |\n"
            "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    lines = [head]
    for r in table:
        pp, fits = r.paper_prediction, "" if r.paper_prediction.fits() else " (over a capacity)"
        if r.result is None:
            lines.append(f"| {r.model} | {r.prompt_len} | - | {r.paper.throughput:.2f} | - | nothing fits | "
                         f"{r.paper.gbs} x {r.paper.num_gpu_batches}; {_pct(r.paper_policy)} | "
                         f"{pp.throughput:.3f}{fits} |")
            continue
        p = r.result.policy
        cpu = ", CPU attention" if p.delegates_attention else ""
        lines.append(f"| {r.model} | {r.prompt_len} | {r.result.throughput:.3f} | {r.paper.throughput:.2f} | "
                     f"{r.ratio:.2f} | {p.gbs} x {p.num_gpu_batches}; {_pct(p)}{cpu} | "
                     f"{r.paper.gbs} x {r.paper.num_gpu_batches}; {_pct(r.paper_policy)} | {pp.throughput:.3f}{fits} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m localgen.policy.table2", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="flexgen_t4", help="shipped profile name or JSON path")
    ap.add_argument("--tiers", choices=("any", "fewest"), action="append",
                    help="the search's tiers option, repeatable (default: both tables)")
    args = ap.parse_args(argv)
    hw = load_profile(args.profile)
    print(f"profile {hw.name}; gen_len {GEN_LEN}; FlexGen Table 2, no compression")
    for tiers in args.tiers or ("any", "fewest"):
        print(f"\nsearch tiers={tiers}\n")
        print(markdown(rows(hw, tiers)))


if __name__ == "__main__":
    main()
