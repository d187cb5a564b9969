"""The ``vescale`` command driven as a user drives it (subprocess): help, plan, checkpoint tools, errors.

``vescale train`` runs in ``test_vescale_cli_train.py``; these tests start no ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import transformers

from vescale.cli.models import PRESETS
from vescale.planner import Plan, generate_plan

VESCALE = Path(sys.executable).parent / "vescale"


def run_vescale(
    *arguments: str, cwd: Path | None = None, extra_environment: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    assert VESCALE.is_file(), f"{VESCALE} is missing: install the meta-package (bash tools/setup.sh)"
    # Wide enough that rich wraps no table cell the tests look for.
    environment = {**os.environ, "COLUMNS": "200", **(extra_environment or {})}
    return subprocess.run(
        [str(VESCALE), *arguments],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        env=environment,
        check=False,
    )


def run_all(*invocations: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """Independent ``vescale`` invocations at once (each start-up is one core's import of torch)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda arguments: run_vescale(*arguments), invocations))


def test_help_names_every_command_and_the_train_options():
    top = run_vescale("--help")
    assert top.returncode == 0, top.stderr
    for command in ("train", "plan", "checkpoint"):
        assert command in top.stdout
    train_help = run_vescale("train", "--help")
    assert train_help.returncode == 0, train_help.stderr
    for option in (
        "--model", "--data", "--nproc", "--steps", "--constraints", "--checkpoint-dir", "--resume",
        "--compile", "--compare-single-device", "--plot", "--nnodes", "--node-rank", "--rdzv-endpoint",
    ):  # fmt: skip
        assert option in train_help.stdout, option
    checkpoint_help = run_vescale("checkpoint", "--help")
    assert "inspect" in checkpoint_help.stdout and "export-hf" in checkpoint_help.stdout


def _meta_preset(name: str) -> torch.nn.Module:
    preset = PRESETS[name]
    config = transformers.AutoConfig.for_model(preset.model_type, **preset.fields)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_plan_json_round_trips_and_equals_generate_plan(tmp_path):
    constraints = {"tensor_parallel.size": 2, "zero.stage": 1}
    out = tmp_path / "plan.json"
    completed = run_vescale(
        "plan",
        "--model",
        "tiny-llama",
        "--world-size",
        "4",
        "--constraints",
        json.dumps(constraints),
        "--json",
        str(out),
    )
    assert completed.returncode == 0, completed.stderr
    assert "mesh                      pp=1  dp=2  ep=1  tp=2" in completed.stdout
    assert "ZeRO-1" in completed.stdout and "why" in completed.stdout
    plan = Plan.from_json(out.read_text())
    # The command is the planner on the preset's meta model: the same plan as the API call. Compared as
    # dicts: the sharding plan's pattern order follows set iteration, which differs between processes.
    assert plan.to_dict() == generate_plan(_meta_preset("tiny-llama"), constraints, world_size=4).to_dict()
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_of_llama_3_70b_on_1024_ranks(tmp_path):
    constraints = tmp_path / "constraints.json"
    constraints.write_text(
        json.dumps({"devices_per_node": 8, "mixed_precision": "bf16", "memory_per_device_gb": 80})
    )
    completed = run_vescale(
        "plan", "--model", "llama-3-70b", "--world-size", "1024", "--constraints", str(constraints)
    )
    assert completed.returncode == 0, completed.stderr
    assert "70,553.7M parameters" in completed.stdout
    assert "world size                1024" in completed.stdout
    assert "mixed precision           bf16" in completed.stdout
    assert "of 80.00 GiB" in completed.stdout


def test_plan_errors_are_one_line_with_the_fix(tmp_path, assert_one_line_error):
    bad_config = tmp_path / "config.json"
    bad_config.write_text(json.dumps({"hidden_size": 64}))
    missing, misspelled, no_type, tp3, typo, not_json = run_all(
        ("plan", "--model", str(tmp_path / "missing" / "config.json")),
        ("plan", "--model", "tiny-lama"),
        ("plan", "--model", str(bad_config)),
        ("plan", "--world-size", "4", "--constraints", '{"tensor_parallel.size": 3}'),
        ("plan", "--constraints", '{"tensor_parallel.sizes": 2}'),
        ("plan", "--constraints", "{not json"),
    )
    assert_one_line_error(missing, "no such file", "pass a transformers config.json, a preset")
    assert_one_line_error(misspelled, "is not a preset", "did you mean 'tiny-llama'?")
    assert_one_line_error(no_type, 'no "model_type"')
    assert_one_line_error(tp3, "tensor_parallel.size=3", "does not divide the world size 4")
    assert_one_line_error(typo, "did you mean 'tensor_parallel.size'?")
    assert_one_line_error(not_json, "is not valid JSON")


def test_plan_of_a_users_module_class_function_or_config(tmp_path, assert_one_line_error):
    (tmp_path / "my_models.py").write_text(
        "import transformers\n"
        "from vescale.cli.models import PRESETS\n"
        "CONFIG = transformers.LlamaConfig(**PRESETS['tiny-llama'].fields)\n"
        "class Tiny(transformers.LlamaForCausalLM):\n"
        "    def __init__(self):\n"
        "        super().__init__(CONFIG)\n"
    )
    # Imported from the working directory, as `python -m` would.
    completed = run_vescale("plan", "--model", "my_models:Tiny", "--world-size", "2", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    parameters = sum(parameter.numel() for parameter in _tiny_llama().parameters())
    assert f"model Tiny: Tiny, {parameters / 1e6:.1f}M parameters" in completed.stdout
    assert "mesh                      pp=1  dp=2  ep=1  tp=1" in completed.stdout
    assert_one_line_error(
        run_vescale("plan", "--model", "my_models:Small", cwd=tmp_path),
        "module 'my_models' has no attribute 'Small'",
    )


def _tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(**PRESETS["tiny-llama"].fields)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_checkpoint_inspect_and_export_hf(tmp_path):
    from vescale.dcheckpoint import save

    model = _tiny_llama()
    plan = generate_plan(_meta_preset("tiny-llama"), world_size=1)
    run_dir = tmp_path / "run"
    save(run_dir / "step-000003", {"model": model, "plan": plan.to_dict(), "step": 3})
    model.config.to_json_file(str(run_dir / "config.json"))

    out = tmp_path / "hf"
    inspected, exported = run_all(
        ("checkpoint", "inspect", str(run_dir)), ("checkpoint", "export-hf", str(run_dir), str(out))
    )
    assert inspected.returncode == 0, inspected.stderr
    assert "step-000003" in inspected.stdout
    assert "model/model.embed_tokens.weight" in inspected.stdout
    assert "256x128" in inspected.stdout and "float32" in inspected.stdout
    assert "non-tensor state: model, plan, step" in inspected.stdout
    assert (
        "saved plan:" in inspected.stdout and "data parallel             1, ZeRO-0 (DDP)" in inspected.stdout
    )

    assert exported.returncode == 0, exported.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name  # a copy of the saved bytes: bitwise


def test_checkpoint_errors_are_one_line(tmp_path, assert_one_line_error):
    inspected, exported = run_all(
        ("checkpoint", "inspect", str(tmp_path)),
        ("checkpoint", "export-hf", str(tmp_path / "missing"), str(tmp_path / "out")),
    )
    assert_one_line_error(inspected, "no checkpoint at", "--checkpoint-dir")
    assert_one_line_error(exported, "no checkpoint at")


def test_train_refuses_bad_options_before_starting_ranks(tmp_path, assert_one_line_error):
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "latest").write_text("step-000010\n")
    no_steps, no_endpoint, tp3, nothing_to_resume, already_saved, restarts_without_saves, no_data = run_all(
        ("train", "--steps", "0"),
        ("train", "--nnodes", "2"),
        ("train", "--nproc", "2", "--checkpoint-dir", str(tmp_path / "a"),
         "--constraints", '{"tensor_parallel": {"size": 3}}'),
        ("train", "--resume", "--checkpoint-dir", str(tmp_path / "empty")),
        ("train", "--checkpoint-dir", str(tmp_path / "done")),
        ("train", "--max-restarts", "2", "--checkpoint-dir", str(tmp_path / "b")),
        # A user error is not retried however many restarts are allowed: one line, before any rank.
        ("train", "--max-restarts", "2", "--save-every", "5", "--data", str(tmp_path / "missing.jsonl"),
         "--checkpoint-dir", str(tmp_path / "c")),
    )  # fmt: skip
    assert_one_line_error(no_steps, "--steps 0", "at least 1 step")
    assert_one_line_error(no_endpoint, "--nnodes 2 needs --rdzv-endpoint HOST:PORT")
    assert_one_line_error(tp3, "tensor_parallel.size=3", "does not divide the world size 2")
    assert_one_line_error(nothing_to_resume, "holds no checkpoint", "train without --resume first")
    assert_one_line_error(already_saved, "already holds a checkpoint", "pass --resume")
    assert_one_line_error(restarts_without_saves, "--max-restarts 2 resumes from", "pass --save-every N")
    assert_one_line_error(no_data, "missing.jsonl", "no such file")


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, assert_one_line_error):
    # Hide matplotlib as an install without the plot extra lacks it: a None entry in sys.modules,
    # set at start-up by a sitecustomize.py that comes first on the path.
    hiding = tmp_path / "hide_matplotlib"
    hiding.mkdir()
    (hiding / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    python_path = os.pathsep.join(filter(None, [str(hiding), os.environ.get("PYTHONPATH")]))
    completed = run_vescale(
        "train", "--plot", str(tmp_path / "loss.png"), "--checkpoint-dir", str(tmp_path / "run"),
        extra_environment={"PYTHONPATH": python_path},
    )  # fmt: skip
    assert_one_line_error(completed, "--plot needs matplotlib", "pip install 'vescale[plot]'")
    assert not (tmp_path / "run").exists(), "checked before any rank started"


def test_multi_node_flags_reach_torchrun_unchanged():
    from torch.distributed.run import config_from_args, parse_args

    from vescale.cli.train_command import LaunchOptions, torchrun_arguments
    from vescale.cli.train_options import TrainOptions

    launch = LaunchOptions(nproc=8, nnodes=2, node_rank=1, rdzv_endpoint="node0.example:29500")
    arguments = parse_args(torchrun_arguments(TrainOptions(steps=5), launch))
    config, _, entry_arguments = config_from_args(arguments)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
    assert config.rdzv_endpoint == "node0.example:29500" and config.rdzv_configs["rank"] == 1
    assert entry_arguments[-2:] == ["vescale.cli.train_worker", TrainOptions(steps=5).to_json()]
    assert not arguments.standalone
    single = parse_args(torchrun_arguments(TrainOptions(), LaunchOptions(nproc=4)))
    assert single.standalone and single.nproc_per_node == "4"


def test_comparison_names_the_worst_step_and_why_curves_are_not_bitwise():
    from vescale.cli.comparison import agreement_summary
    from vescale.cli.run_layout import RunLayout

    reference = [5.0, 4.0, 3.0, 2.0]
    deterministic = RunLayout(global_batch_size=32, sequence_length=128, data_parallel=4, deterministic=True)
    assert agreement_summary(reference, list(reference), deterministic) == [
        "the curves are bitwise equal at all 4 steps (deterministic data parallelism: the ranks' "
        "gradients are summed in rank order, as the reference accumulates the same micro-batches)"
    ]
    # 1e-6 at step 3 and 6e-4 (beyond the 1e-4) at step 4, relative to max |reference| = 5.
    parallel = [5.0, 4.0, 3.0 + 5e-6, 2.0 + 3e-3]
    tensor_parallel = RunLayout(
        global_batch_size=32, sequence_length=128, data_parallel=2, tensor_parallel=2, deterministic=True
    )
    worst, bound, why = agreement_summary(parallel, reference, tensor_parallel)
    assert worst == (
        "max relative difference over 4 steps: 6.00e-04 at step 4 (equal bit for bit up to step 2)"
    )
    assert bound == "the curves agree within 1e-04 relative up to step 3"
    assert why.startswith("why not bitwise: tensor parallelism (tp=2) adds partial matmul sums across ranks")
    _, _, why = agreement_summary(parallel, reference, RunLayout(32, 128, data_parallel=4))
    assert "the data-parallel all-reduce sums in the backend's order" in why
    on_gpus = RunLayout(32, 128, data_parallel=4, deterministic=True, device_type="cuda")
    assert agreement_summary(parallel, reference, on_gpus)[2] == (
        "why not bitwise: the ranks ran cuda kernels, the reference CPU ones: float32 rounding differs "
        "from one process, and training amplifies it"
    )
    # Equal without deterministic mode (2 ranks add g_0 + g_1 in either order): no reason claimed.
    assert agreement_summary(reference, list(reference), RunLayout(32, 128, data_parallel=2)) == [
        "the curves are bitwise equal at all 4 steps"
    ]
    # Deterministic and unequal is a bug, and the line says so.
    assert "unexpected" in agreement_summary(parallel, reference, deterministic)[2]
