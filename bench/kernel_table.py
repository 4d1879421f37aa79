"""The static GPU report's text table (a row per kernel build), shared by `python -m bench.inspect`,
`python -m bench.triton_report` and `python -m bench.cuda_report`: below all three, importing none."""

from __future__ import annotations


def format_table(rows: list[dict]) -> str:
    """The rows of either backend's report as one aligned text table (a row per kernel build)."""
    def text(value):
        return "-" if value is None else str(value)

    header = ("backend", "kernel", "target", "cubin arch", "dtype", "D", "causal", "dropout", "bias grad", "scores",
              "config", "regs",
              "spill B", "stack B", "smem KiB", "tensor-core ops", "TMA ops", "launch warps", "fits")
    lines = [header]
    for row in rows:
        tensor_cores = " ".join(f"{name}:{count}" for name, count in
                                sorted(row["tensor_core_instructions"].items())) or "-"
        tma = " ".join(f"{name}:{count}" for name, count in sorted(row.get("tma_instructions", {}).items())) or "-"
        lines.append((row["backend"], row["kernel"], row["target"], text(row.get("cubin_arch")), text(row["dtype"]),
                      text(row["head_dim"]), text(row["causal"]), text(row.get("dropout")), text(row.get("bias_grad")),
                      text(row.get("scores")), row["config"],
                      str(row["registers"]),
                      str(row["spill_bytes"]),
                      str(row["stack_bytes"]), f"{row['shared_bytes'] / 1024:.1f}", tensor_cores, tma,
                      text(row.get("launch_warps")),
                      "yes" if row["fits"] else "NO: " + "; ".join(row["problems"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in lines)
