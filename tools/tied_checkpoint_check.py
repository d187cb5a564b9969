"""Issue #18's tied-embedding checkpoint check: one tensor on disk, and an HF export that loads.

For each architecture (default GPT-2, Gemma, OPT: tied input and output embeddings at their
defaults), 4 ranks run the RFC's script under dp2 x tp2 with ZeRO-3 for 3 AdamW steps and
``vescale.save``; then, in this process, the checkpoint's index is read (how many tensors hold
the tied embedding), ``vescale.dcheckpoint.export_hf`` writes it as safetensors beside the
model's ``config.json``, and ``from_pretrained`` loads it: no missing or unexpected keys, the
input and output embeddings one tensor, and its loss on the next batch equal to the parallel
model's (1e-5 relative).

Example::

    python tools/tied_checkpoint_check.py --archs gpt2,gemma,opt
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

TOOLS_DIRECTORY = os.path.dirname(os.path.abspath(__file__))
if TOOLS_DIRECTORY not in sys.path:
    sys.path.insert(0, TOOLS_DIRECTORY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TOOLS_DIRECTORY, os.environ.get("PYTHONPATH")]))

LOSS_RTOL = 1e-5


def save_on_rank(arch: str, path: str) -> dict:
    """Train 3 steps under dp2 x tp2 ZeRO-3, save; the loss of the next batch (every rank)."""
    import torch
    from hf_sweep_lib.parallelize_modes import CONSTRAINTS, _build, _train

    import vescale
    from vescale.dtensor.testing.models.hf_architectures import tiny_causal_lm_batch

    plan, model, optimizer, loader = _build(arch, CONSTRAINTS["dp2xtp2-zero3"])
    _train(model, optimizer, loader, 3)
    vescale.save(path, {"plan": plan, "model": model, "optimizer": optimizer})
    input_ids, labels = tiny_causal_lm_batch(seed=7)
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=labels).loss
    return {"loss": loss.item()}


def check(arch: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from vescale.dcheckpoint import export_hf
    from vescale.dcheckpoint.api import read_index
    from vescale.dcheckpoint.atomic import resolve_checkpoint
    from vescale.dtensor.testing import run_on_ranks
    from vescale.dtensor.testing.models.hf_architectures import build_tiny_causal_lm, tiny_causal_lm_batch

    with tempfile.TemporaryDirectory(prefix="tied-check-") as directory:
        path = os.path.join(directory, "checkpoint")
        results = run_on_ranks(save_on_rank, 4, args=(arch, path), timeout_s=600)
        index = read_index(resolve_checkpoint(Path(path)))
        model = build_tiny_causal_lm(arch)
        embedding = model.get_input_embeddings().weight
        named = model.named_parameters(remove_duplicate=False)
        tied_names = [name for name, parameter in named if parameter is embedding]
        on_disk = [name for name in tied_names if f"model/{name}" in index.tensors]
        out = os.path.join(directory, "hf")
        export_hf(path, out)
        model.config.save_pretrained(out)
        exported, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        input_ids, labels = tiny_causal_lm_batch(seed=7)
        with torch.no_grad():
            loss = exported(input_ids=input_ids, labels=labels).loss.item()
        parallel_loss = results[0]["loss"]
        return {
            "tied names": tied_names,
            "tensors on disk": len(on_disk),
            "missing/unexpected": len(info["missing_keys"]) + len(info["unexpected_keys"]),
            "exported tied": exported.get_input_embeddings().weight.data_ptr()
            == exported.get_output_embeddings().weight.data_ptr(),
            "loss rel": abs(loss - parallel_loss) / abs(parallel_loss),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="gpt2,gemma,opt")
    args = parser.parse_args()
    failed = False
    print(
        "| architecture | tied names | tensors on disk | missing/unexpected keys | exported tied | loss rel |"
    )
    print("|---|---|---|---|---|---|")
    for arch in args.archs.split(","):
        try:
            row = check(arch)
        except Exception as error:  # a failed architecture is a row of the table, not the end of it
            failed = True
            print(f"| {arch} | {type(error).__name__}: {str(error).splitlines()[0][:160]} | | | | |")
            continue
        ok = (
            row["tensors on disk"] == 1
            and row["missing/unexpected"] == 0
            and row["exported tied"]
            and row["loss rel"] <= LOSS_RTOL
        )
        failed |= not ok
        print(
            f"| {arch} | {', '.join(row['tied names'])} | {row['tensors on disk']} | "
            f"{row['missing/unexpected']} | {row['exported tied']} | {row['loss rel']:.1e} |"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
