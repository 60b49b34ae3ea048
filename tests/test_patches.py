"""Tests for ``patches``: each fix is needed, works, applies once, and only where needed.

Everything that depends on process-wide patch state runs in fresh interpreters
(``tests/_patches_worker.py``, see its docstring), all started at once by the ``workers``
fixture since imports dominate their run time:

* ``single_rank`` once with every patch and once per patch with that patch skipped: a check
  must fail exactly when a patch it needs is skipped, so each patch is shown necessary,
  sufficient for its call sites, and independent of the others;
* ``selection`` with CUDA faked on and apex faked present or blocked;
* ``two_ranks``: a tiny GPT trained on 2 gloo ranks with TP=2 + SP, then PP=2, and a group
  made on the store (``torch_process_group``).

The version pins are checked in-process against faked installed versions (the torch builds of
NVIDIA's containers pass, other torch releases are refused in one line), and end to end by a
one-rank run whose torch metadata reads a container's version, or an unsupported one.

Run with another torch's Python (a venv holding that torch), this file is the check that
verifies the call sites on that torch (docs/gpu_clusters.md, "Supported torch").
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import harness
from harness import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER_PATH = Path(__file__).resolve().with_name("_patches_worker.py")
SKIP_ENV = "MEGATRON_STREAMING_SKIP_PATCHES"
ALL_PATCHES = (
    "megatron_rng",
    "megatron_devices",
    "megatron_embedding",
    "megatron_norm",
    "deepspeed_shm",
    "deepspeed_cpu_fp16",
    "torch_dcp_safe_metadata",
    "megatron_moe",
)


def _load_worker_module():
    # By path, so this works under any pytest import mode; it imports nothing heavy.
    spec = importlib.util.spec_from_file_location("_patches_worker", WORKER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker_module()


# --------------------------------------------------------------------------------------------
# Launching workers (pytest side)
# --------------------------------------------------------------------------------------------


def _start(scenario: str, env: dict, log) -> subprocess.Popen:
    if scenario == "single_rank":
        # Imports megatron-core before apply(), as the session's zygote has: a process
        # forked from it starts as fresh as to patches (the zygote applies none) and skips
        # the imports. The others import in an order of their own (selection fakes CUDA
        # and apex at import; two_ranks applies before any megatron import).
        full_env = harness.env(env)  # env names the patch to skip, if any
        cmd = harness.command(1, [scenario], str(WORKER_PATH.relative_to(REPO)), full_env)
    else:
        full_env = {k: v for k, v in os.environ.items() if k != SKIP_ENV}
        full_env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1",
                        **env)
        cmd = [sys.executable, str(WORKER_PATH), scenario]
    # Output goes to a file, not a pipe: nothing reads a pipe until the worker is collected,
    # and a full pipe would block the worker.
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)


class _Workers:
    """Every worker process of this file, started together (imports dominate, 2 cores share
    them) and collected one by one, so one failing worker fails only the tests that read it."""

    def __init__(self, log_dir: Path, timeout: float = 220):
        self._procs, self._results, self._timeout = {}, {}, timeout
        self._log_dir = log_dir
        self.shm_ports = []

    def start(self, key, scenario: str, env: dict) -> None:
        log_path = self._log_dir / f"worker{len(self._procs)}.log"
        with open(log_path, "w") as log:
            self._procs[key] = (_start(scenario, env, log), log_path)

    def result(self, key) -> dict:
        if key not in self._results:
            self._results[key] = self._collect(*self._procs[key])
        return self._results[key]

    def _collect(self, proc: subprocess.Popen, log_path: Path) -> dict:
        try:
            proc.wait(timeout=self._timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"worker timed out after {self._timeout}s:\n{log_path.read_text()[-6000:]}")
        out = log_path.read_text()
        lines = [line for line in out.splitlines() if line.startswith(worker.RESULT_PREFIX)]
        assert proc.returncode == 0 and lines, f"worker rc={proc.returncode}:\n{out[-6000:]}"
        return json.loads(lines[-1][len(worker.RESULT_PREFIX):])

    def stop(self) -> None:
        for proc, _ in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for port in self.shm_ports:
            for path in worker.shm_files(port):
                os.remove(path)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    pool = _Workers(tmp_path_factory.mktemp("patch_workers"))
    # single_rank with every patch (key None) and with each patch skipped (key: its name).
    for skipped in (None, *ALL_PATCHES):
        port = free_port()
        pool.shm_ports.append(port)
        pool.start(skipped, "single_rank", {SKIP_ENV: skipped or "", "MASTER_PORT": str(port)})
    for key, cuda, apex in (("cuda_with_apex", "1", "present"),
                            ("cuda_without_apex", "1", "blocked"),
                            ("cpu_without_apex", "0", "blocked")):
        pool.start(key, "selection", {"FAKE_CUDA": cuda, "FAKE_APEX": apex})
    two_ranks = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for rank in range(2):
        pool.start(("two_ranks", rank), "two_ranks", {**two_ranks, "RANK": str(rank)})
    try:
        yield pool
    finally:
        pool.stop()


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


# Upstream code reaching for CUDA on a host without it, as each torch build says so.
_NO_CUDA = (
    "Torch not compiled with CUDA enabled",  # a CPU build
    "Found no NVIDIA driver",  # a CUDA build (PyPI's) on a host without a GPU
    # the same, in a process forked (from the tests' zygote) after torch looked for a GPU
    "Cannot re-initialize CUDA in forked subprocess",
)

# What a check reports when a patch it needs is skipped: the upstream failure that patch fixes
# (one of these texts).
_EXPECTED_FAILURE = {
    "megatron_rng": _NO_CUDA,
    "megatron_devices": _NO_CUDA,
    "megatron_embedding": _NO_CUDA,
    "megatron_norm": ("not supported by torch LayerNorm",),  # sequence parallel, zero-centred
    "deepspeed_shm": ("shm op build requested",),
    "deepspeed_cpu_fp16": ("Type fp16 is not supported",),
    "torch_dcp_safe_metadata": ("reading .metadata ran code from the file",),
    "megatron_moe": ("name 'te_general_gemm' is not defined",),
}


@pytest.mark.timeout(240)
def test_all_patches_make_every_call_site_work(workers):
    result = workers.result(None)
    assert result["applied"] == list(ALL_PATCHES)
    assert result["checks"] == {name: "ok" for name in worker.CHECK_NEEDS}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("skipped", ALL_PATCHES)
def test_each_patch_is_needed_and_independent(workers, skipped):
    result = workers.result(skipped)
    assert result["applied"] == [p for p in ALL_PATCHES if p != skipped]
    broken = {name for name, outcome in result["checks"].items() if outcome != "ok"}
    needing = {name for name, needs in worker.CHECK_NEEDS.items() if skipped in needs}
    assert broken == needing, result
    for name in broken:  # failed for the reason the patch addresses, not something else
        assert any(text in result["checks"][name] for text in _EXPECTED_FAILURE[skipped]), \
            result


@pytest.mark.timeout(240)
def test_apply_is_idempotent(workers):
    result = workers.result(None)
    assert result["second_apply"] == result["applied"]
    assert result["patched_objects_unchanged"] is True


@pytest.mark.timeout(240)
def test_deepspeed_init_leaves_no_shm_files(workers):
    # The worker asserts this itself; check from outside too, per worker port.
    assert workers.result(None)["checks"]["deepspeed_init_no_shm"] == "ok"
    assert workers.result(None)["shm_files"] == []


@pytest.mark.timeout(240)
def test_selection_cuda_untouched_and_norm_fallback(workers):
    results = {key: workers.result(key)
               for key in ("cuda_with_apex", "cuda_without_apex", "cpu_without_apex")}
    # On a CUDA host, with apex or without, only the torch norm's fix (RMSNorm models take
    # torch's norm with apex too), checkpoint-metadata safety (not a CPU matter: it applies
    # everywhere) and the MoE router's missing name without Transformer Engine (which these
    # hosts lack) are touched; the CUDA path stays upstream's.
    safe = ["megatron_norm", "torch_dcp_safe_metadata", "megatron_moe"]
    for key in ("cuda_with_apex", "cuda_without_apex"):
        assert results[key]["applied"] == safe
        assert sorted(results[key]["touched"]) == sorted(safe)
    # apex / TE not importable: flags false and the norm fallback active.
    cpu = results["cpu_without_apex"]
    assert cpu["have_apex"] is False and cpu["have_te"] is False
    assert "megatron_norm" in cpu["applied"]
    assert sorted(cpu["touched"]) == sorted(ALL_PATCHES)


@pytest.mark.parametrize("package, found, skip", [
    ("megatron-core", "0.17.0", ["deepspeed_shm"]),  # skip: keeps deepspeed out of pytest
    ("megatron-core", "0.16.2rc0+ab12cd", ["deepspeed_shm"]),
    ("deepspeed", "0.20.0", []),
    ("deepspeed", "0.19.7", []),
])
def test_version_refusal_names_package_found_and_expected(monkeypatch, package, found, skip):
    import patches
    from patches import _pinning

    versions = {"megatron-core": "0.16.1", "deepspeed": "0.19.8", "torch": "2.13.0+cpu"}
    expected = versions[package]
    monkeypatch.setattr(_pinning, "installed_version", {**versions, package: found}.get)
    monkeypatch.setattr(patches, "_APPLIED", [])  # as in a fresh process
    with pytest.raises(patches.UpstreamVersionError) as err:
        patches.apply(skip=skip)
    message = str(err.value)
    assert message.startswith(f"{package} {found} is not supported: patch "), message
    assert f"supports {package} {expected} and its pre-release" in message, message
    assert "\n" not in message
    assert patches.applied() == []  # refused before installing anything


# torch as NVIDIA's PyTorch containers report it (26.10-like, 26.08, 25.12), and releases.
CONTAINER_TORCH = ("2.13.0a0+4f3e2b1.nv26.10", "2.14.0a0+4fdf77b940.nv26.8.63802676",
                   "2.10.0a0+b4e4ee81d3", "2.11.0a0+eb65b36914.nv26.02",
                   "2.12.0a0+0291f960b6.nv26.04.48445190")
RELEASED_TORCH = ("2.10.0", "2.11.0+cu130", "2.12.0", "2.13.0+cpu", "2.14.1", "2.15.0",
                  "2.13.1rc1", "2.15.0a0+x")
REFUSED_TORCH = ("2.9.1", "2.16.0", "2.16.0a0+x", "2.9.0a0+b4e4ee81d3.nv25.10", "3.0.0")
SUPPORTED_TORCH_TEXT = "2.10.x, 2.11.x, 2.12.x, 2.13.x, 2.14.x, 2.15.x"


# The modules that reach torch's private names (a patch, two adapters).
TORCH_PINNED = ("torch_dcp_safe_metadata", "torch_process_group", "megatron_checkpoint_writer")


def test_every_torch_pin_is_the_one_supported_list():
    """No torch version is written in patches/ but in _pinning's list, which every module
    that reaches torch's private names holds."""
    import re

    from patches import _pinning

    for path in (REPO / "patches").glob("*.py"):
        if path.name != "_pinning.py":
            assert not re.search(r"[\"']2\.\d+(\.\d+)?[\"']", path.read_text()), path
    for name in TORCH_PINNED:
        module = importlib.import_module(f"patches.{name}")
        assert any(value is _pinning.TORCH_VERSIONS for value in vars(module).values()), name
    assert _pinning.described(_pinning.TORCH_VERSIONS) == SUPPORTED_TORCH_TEXT


@pytest.mark.parametrize("found", CONTAINER_TORCH + RELEASED_TORCH)
def test_container_and_released_torch_pass_every_torch_pin(monkeypatch, found):
    from patches import _pinning

    monkeypatch.setattr(_pinning, "installed_version", {"torch": found}.get)
    for name in TORCH_PINNED:
        _pinning.require_version("torch", _pinning.TORCH_VERSIONS, name)  # raises if refused


@pytest.mark.parametrize("found", REFUSED_TORCH)
def test_other_torch_is_refused_in_one_line_naming_the_supported_versions(monkeypatch, found):
    from types import SimpleNamespace

    import patches
    from patches import _pinning, megatron_checkpoint_writer, torch_process_group

    monkeypatch.setattr(_pinning, "installed_version",
                        {"megatron-core": "0.16.1", "deepspeed": "0.19.8", "torch": found}.get)
    monkeypatch.setattr(patches, "_APPLIED", [])  # as in a fresh process
    _pinning.require_version_once.cache_clear()
    others = [name for name in ALL_PATCHES if name != "torch_dcp_safe_metadata"]
    refusals = []
    for name, call in (
            # the others would install upstream changes in pytest
            ("torch_dcp_safe_metadata", lambda: patches.apply(skip=others)),
            ("torch_process_group",
             lambda: torch_process_group.standalone_group("gloo", None, 0, 1, None)),
            ("megatron_checkpoint_writer",
             lambda: megatron_checkpoint_writer.write_files(SimpleNamespace(), None)),
            ("megatron_checkpoint_writer",
             lambda: megatron_checkpoint_writer.results_from_json([]))):
        with pytest.raises(patches.UpstreamVersionError) as err:
            call()
        refusals.append((err, name))
    for error, name in refusals:
        message = str(error.value)
        assert message == (
            f"torch {found} is not supported: patch {name!r} supports torch "
            f"{SUPPORTED_TORCH_TEXT} and their pre-release and local builds; install one of "
            f"those, or re-verify the call sites of patches/{name}.py (tests/test_patches.py) "
            f"and extend its pin"), message
    assert patches.applied() == []


def test_offline_tools_refuse_an_unsupported_torch_as_a_checkpoint_error(monkeypatch, tmp_path):
    """``python -m megatron_streaming.checkpoint`` prints a CheckpointError as one line."""
    import patches
    from megatron_streaming.checkpoint import megatron_export, offline
    from megatron_streaming.checkpoint.resume import CheckpointError
    from patches import _pinning

    monkeypatch.setattr(_pinning, "installed_version",
                        {"megatron-core": "0.16.1", "deepspeed": "0.19.8", "torch": "2.16.0"}.get)
    monkeypatch.setattr(patches, "_APPLIED", [])
    for call in (lambda: offline.read_tensors(str(tmp_path), []),
                 lambda: megatron_export.build_filled_model(None, {})):
        with pytest.raises(CheckpointError, match=r"^torch 2\.16\.0 is not supported: "):
            call()
    assert patches.applied() == []


def test_megatron_and_deepspeed_pins_admit_builds_of_their_release(monkeypatch):
    """The exact pins take a release's pre-release and local builds (a container's), not a
    neighbouring release."""
    from patches import _pinning

    for found in ("0.16.1", "0.16.1rc0+2f1e0a9", "0.16.1+nv26.10", "0.16.1.post1"):
        assert _pinning.admits("0.16.1", found), found
    for found in ("0.16.0", "0.16.2", "0.16.10", "0.16", "0.17.0rc0", "not-a-version"):
        assert not _pinning.admits("0.16.1", found), found
    assert _pinning.admits("2.13", "2.13.0a0+4f3e2b1.nv26.10")
    assert not _pinning.admits("2.1", "2.13.0")  # numbers, not characters


def test_adapters_refuse_another_version_before_touching_anything(monkeypatch):
    """The adapters to private upstream state refuse another release, naming the adapter."""
    from types import SimpleNamespace

    from patches import (_pinning, deepspeed_zero, megatron_checkpoint_writer,
                         megatron_parallel_state, megatron_row_parallel, megatron_save_plan,
                         torch_process_group)

    monkeypatch.setattr(_pinning, "installed_version",
                        {"megatron-core": "0.17.0", "deepspeed": "0.20.0",
                         "torch": "2.16.0+cpu"}.get)
    _pinning.require_version_once.cache_clear()  # as in a fresh process
    optimizer = SimpleNamespace(single_partition_of_fp32_groups=[])
    with pytest.raises(_pinning.UpstreamVersionError,
                       match=r"^deepspeed 0\.20\.0 is not supported: patch 'deepspeed_zero' "
                             r"supports deepspeed 0\.19\.8 "):
        deepspeed_zero.is_zero(optimizer)
    with pytest.raises(_pinning.UpstreamVersionError,
                       match=r"'megatron_parallel_state' .*supports megatron-core 0\.16\.1 "):
        megatron_parallel_state.install_groups({}, {})
    with pytest.raises(_pinning.UpstreamVersionError,
                       match=r"'megatron_row_parallel' .*supports megatron-core 0\.16\.1 "):
        megatron_row_parallel.partial_sum(SimpleNamespace(), None)
    with pytest.raises(_pinning.UpstreamVersionError,
                       match=r"'megatron_checkpoint_writer' .*supports megatron-core 0\.16\.1 "):
        megatron_checkpoint_writer.in_process_results()
    with pytest.raises(_pinning.UpstreamVersionError,
                       match=r"'megatron_checkpoint_writer' .*supports megatron-core 0\.16\.1 "):
        megatron_checkpoint_writer.write_files(SimpleNamespace(), None)
    for plan in (lambda plans: plans.request({}, "unused", reuse=False),
                 lambda plans: plans.plan_ahead({}, "unused")):
        with pytest.raises(_pinning.UpstreamVersionError,
                           match=r"'megatron_save_plan' .*supports megatron-core 0\.16\.1 "):
            plan(megatron_save_plan.SavePlans())
    with pytest.raises(_pinning.UpstreamVersionError,
                       match=r"^torch 2\.16\.0\+cpu is not supported: patch "
                             r"'torch_process_group' supports torch 2\.10\.x, 2\.11\.x, "
                             r"2\.12\.x, 2\.13\.x, 2\.14\.x, 2\.15\.x "):
        torch_process_group.standalone_group("gloo", None, 0, 1, None)


_DCP_ROUND_TRIP = """
import pickle, sys, tempfile, torch, torch.distributed.checkpoint as dcp
from patches import _pinning, torch_dcp_safe_metadata as safe
_pinning.require_version(safe.PATCH.package, safe.PATCH.version, safe.NAME)
safe.install()
class RunsCode:
    def __reduce__(self):
        return (exec, ("import sys; sys.stdout.write('RAN')",))
with tempfile.TemporaryDirectory() as d:
    state = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16),
             "step": 7, "nested": {"m": torch.zeros(4, dtype=torch.int64)}}
    dcp.save(state, checkpoint_id=d, no_dist=True)
    metadata = dcp.FileSystemReader(d).read_metadata()  # through the safe unpickler
    back = {"w": torch.empty(2, 3), "b": torch.empty(2, dtype=torch.bfloat16), "step": 0,
            "nested": {"m": torch.empty(4, dtype=torch.int64)}}
    dcp.load(back, checkpoint_id=d, no_dist=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 7, back
    with open(d + "/.metadata", "wb") as f:
        pickle.dump(RunsCode(), f)
    try:
        dcp.FileSystemReader(d).read_metadata()
    except pickle.UnpicklingError as e:
        print("refused:", e)
print("keys", sorted(metadata.state_dict_metadata))
"""


def test_safe_metadata_reads_what_this_torch_writes_and_refuses_code():
    """torch_dcp_safe_metadata against the installed torch: a checkpoint written by
    torch.distributed.checkpoint (tensors of three dtypes, a nested dict, a plain int) reads
    back through the safe unpickler, and a .metadata that would run code is refused (the
    check that verifies the patch's pin on another torch, e.g. the device machine's)."""
    proc = subprocess.run([sys.executable, "-c", _DCP_ROUND_TRIP], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAN" not in proc.stdout
    assert "refused: checkpoint metadata refers to builtins.exec" in proc.stdout, proc.stdout
    assert "keys ['b', 'nested.m', 'step', 'w']" in proc.stdout, proc.stdout


def test_unknown_skip_name_is_rejected():
    import patches

    with pytest.raises(ValueError, match="megatron_typo"):
        patches.apply(skip="megatron_rng,megatron_typo")


def test_import_is_cheap():
    code = "import sys, patches, patches.optional; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.timeout(240)
def test_tiny_gpt_trains_with_tp_sp_and_pp_on_two_gloo_ranks(workers):
    ranks = {rank: workers.result(("two_ranks", rank)) for rank in range(2)}
    for rank, result in ranks.items():
        assert result["applied"] == list(ALL_PATCHES), rank
        for layout in ("tp2_sp_ddp", "pp2_shared_embedding"):
            assert result[layout]["losses_finite"], (rank, result)
    # SP norm grads were all-reduced over TP: the replicated norm weights stayed identical.
    assert all(ranks[r]["tp2_sp_ddp"]["norm_params_tagged"] for r in range(2))
    assert ranks[0]["tp2_sp_ddp"]["norm_checksum"] == ranks[1]["tp2_sp_ddp"]["norm_checksum"]
    # Shared embedding: first and last stage hold the same weight after init and training.
    assert ranks[0]["pp2_shared_embedding"]["shared_weight_max_diff"] == 0.0
    assert ranks[1]["pp2_shared_embedding"]["last_stage_losses"]
    # A group made on the store outside the world (patches.torch_process_group), group ranks
    # the reverse of the world's: all-reduced, gathered in group order, dropped again.
    for rank, result in ranks.items():
        assert result["standalone_group"] == {
            "sum": 3.0, "gathered": [1.0, 0.0], "backend": "gloo", "rank_in_group": 1 - rank,
            "registered": True, "dropped": True}, rank
    # The ladder's row-parallel partial sum (patches.megatron_row_parallel): reduced over TP
    # it is megatron's output, with the same gradients, the bias handed back apart.
    for rank, result in ranks.items():
        assert result["row_parallel_partial_sum"] == {
            "sum_is_the_output": True, "bias_returned_apart": True, "gradients_equal": True}, rank



def test_megatron_core_imports_without_torch_compile_and_its_fused_functions_still_work():
    """The import hook (patches/megatron_jit.py): megatron-core's import leaves torch._dynamo
    unimported and torch.compile torch's own; a fused function compiles at its first call
    and computes what its eager formula does."""
    code = """
import sys, patches, torch, megatron.core
from megatron.core.fusions.fused_bias_gelu import bias_gelu
assert 'torch._dynamo' not in sys.modules, 'dynamo imported with megatron-core'
assert torch.compile.__module__ == 'torch', torch.compile
x, b = torch.randn(4, 8), torch.randn(8)
y = x + b
want = y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))
assert torch.allclose(bias_gelu(b, x), want, atol=1e-6)
assert 'torch._dynamo' in sys.modules  # compiled at the first call
"""
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=300,
                   env={**os.environ, "TORCH_COMPILE_DISABLE": "1"})


def test_compile_on_first_call_defers_the_real_compile_with_its_options():
    from patches.megatron_jit import compile_on_first_call

    calls = []

    def real(fn, **options):
        calls.append(options)
        return lambda *a: fn(*a) + 100

    lazy = compile_on_first_call(real)
    plain, configured = lazy(lambda x: x), lazy(dynamic=True)(lambda x: 2 * x)
    assert calls == []  # decorating compiles nothing
    assert (plain(1), plain(2), configured(3)) == (101, 102, 106)
    assert calls == [{}, {"dynamic": True}]  # once per function, with its options


# --------------------------------------------------------------------------------------------
# A run under a torch whose installed metadata says otherwise (NVIDIA's container, too new)
# --------------------------------------------------------------------------------------------


def _torch_metadata_reading(root: Path, version: str) -> dict:
    """The environment in which ``importlib.metadata.version("torch")`` is ``version``: a
    dist-info of that version first on PYTHONPATH (the torch imported stays the real one).
    It carries the real torch's entry points: importlib.metadata reads one distribution per
    name, and torch 2.14 registers its gloo and NCCL backends through them."""
    from importlib import metadata

    info = root / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        metadata.distribution("torch").read_text("entry_points.txt") or "")
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    probe = subprocess.run([sys.executable, "-c", "from importlib.metadata import version; "
                            "print(version('torch'))"], env={**os.environ, "PYTHONPATH": path},
                           capture_output=True, text=True, check=True, timeout=60)
    assert probe.stdout.strip() == version, probe
    return {"PYTHONPATH": path}


def _one_rank(tmp_path: Path, torch_version: str):
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": str(free_port()),
           **_torch_metadata_reading(tmp_path / "metadata", torch_version)}
    summary = tmp_path / "summary.json"
    args = [*harness.TINY, "--num-layers", "2", "--train-iters", "3", "--eval-iters", "0",
            "--summary-json", str(summary)]
    return harness.run(1, args, timeout=240, check=False, extra_env=env), summary


@pytest.mark.timeout(300)
def test_a_run_under_a_container_torch_trains(tmp_path):
    """torch reporting itself as NVIDIA's containers do (a pre-release with a local label)."""
    proc, summary = _one_rank(tmp_path, "2.13.0a0+4f3e2b1.nv26.10")
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(summary.read_text())
    assert result["iteration"] == 3 and 0 < result["train_loss"] < 20, result


@pytest.mark.timeout(300)
def test_a_run_under_an_unsupported_torch_stops_with_one_line(tmp_path):
    proc, summary = _one_rank(tmp_path, "2.16.0")
    output = f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 2, output
    assert "Traceback" not in proc.stderr, output
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "pretrain_gpt.py: error: torch 2.16.0 is not supported: patch "
        "'torch_dcp_safe_metadata' supports torch 2.10.x, 2.11.x, 2.12.x, 2.13.x, 2.14.x, "
        "2.15.x and their pre-release and local builds; install one of those, or re-verify "
        "the call sites of patches/torch_dcp_safe_metadata.py (tests/test_patches.py) and "
        "extend its pin"], output
    assert not summary.exists()
