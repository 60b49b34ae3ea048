"""Shared test helpers: small gloo process groups, and a world-1 Megatron set-up in-process."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist



# ---- process groups ---------------------------------------------------------------------------

def _gloo_main(rank, world, store, out_dir, group_timeout_s, hard_exit, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    timeout = datetime.timedelta(seconds=group_timeout_s) if group_timeout_s else None
    group = dist.new_group(list(range(world)), timeout=timeout)
    result = fn(rank, world, group, *args)
    if result is not None:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if hard_exit:
        # A collective left blocked on purpose would keep the interpreter from exiting
        # (the transport's executor thread is joined at exit): leave without tearing down.
        os._exit(0)
    dist.destroy_process_group()


def spawn_gloo(fn, world, tmp_dir, *args, group_timeout_s=None, hard_exit=False):
    """Run ``fn(rank, world, group, *args)`` on ``world`` fresh processes joined by a gloo
    default group (FileStore in ``tmp_dir``) and ``group`` = all of them; returns what each
    rank returned (saved to ``tmp_dir``; None where it returned None)."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.start_processes(
        _gloo_main, args=(world, str(tmp_dir / "store"), str(tmp_dir), group_timeout_s,
                          hard_exit, fn, args),
        nprocs=world, join=True, start_method="spawn")
    paths = [tmp_dir / f"rank{r}.pt" for r in range(world)]
    return [torch.load(p) if p.exists() else None for p in paths]


@pytest.fixture(scope="module")
def megatron_world():
    """World-1 gloo group in this process, Megatron pointed at it (as diloco_reference.py);
    its groups serve mixture-of-experts models too."""
    import patches
    from megatron_streaming.parallel import distributed
    from megatron_streaming.parallel.topology import RankLayout, Topology

    saved_env = dict(os.environ)
    owned = not dist.is_initialized()
    patches.apply()
    distributed.init_distributed("gloo", 5)
    topo = Topology.create(RankLayout(1, moe=True), 0)
    topo.install_into_megatron()
    yield topo
    if owned:
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved_env)



# ---- the quick tier -----------------------------------------------------------------------------
# ``pytest -m quick`` (``bash launch/test.sh -m quick``): the inner loop's subset, a few minutes
# on 2 cores, touching every folder of the package (tests/test_layout.py checks that). These
# files, less their slow tests (launches of several processes, long runs); the README's test
# command stays the whole suite.
QUICK_FILES = (
    "test_layout.py", "test_codec.py", "test_rule.py", "test_streaming_schedule.py",
    "test_streaming_sync.py", "test_streaming_transport.py", "test_crossworker.py",
    "test_stop_agreement.py", "test_membership.py", "test_door.py", "test_schedules.py",
    "test_megatron_flags.py", "test_tokenizers.py", "test_data.py", "test_plan.py",
    "test_simulate.py", "test_topology.py", "test_quiet.py", "test_errors.py", "test_hf.py",
    "test_model.py", "test_attention.py", "test_ladder.py", "test_slurm.py", "test_launch.py",
    "test_checkpoint.py", "test_gpu_environment.py", "test_training.py", "test_moe.py",
    "test_container.py", "test_pinned.py", "test_sparse_codec.py", "test_doc_commands.py",
    "test_sparse_transport.py",
)
QUICK_LEFT_OUT = {
    "test_doc_commands.py": ("test_the_cpu_runnable_doc_commands_run_and_sync",
                             "test_the_readme_two_clusters_run_on_one_machine"),
    "test_container.py": ("test_the_container_command_keeps_the_containers_torch_and_trains",
                          "test_the_container_command_refuses_a_python_without_torch_and_an_isolated_venv"),
    "test_checkpoint.py": ("test_resume_continues_the_uninterrupted_run_exactly",
                           "test_resume_with_a_fragment_in_flight_continues_exactly"),
    "test_errors.py": ("test_load_of_corrupt_checkpoint", "test_load_of_directory_without_checkpoint",
                       "test_load_refuses_what_it_cannot_honour_before_process_groups",
                       "test_unwritable_save_exits_before_process_groups"),
    "test_gpu_environment.py": (
        "test_a_job_trains_the_same_with_apex_and_transformer_engine_importable",),
    "test_ladder.py": ("test_pp2_ladder_equals_pp1", "test_tp2_ladder_equals_tp1"),
    "test_membership.py": ("test_survivors_make_the_next_epochs_groups_without_the_lost_worker",),
    "test_plan.py": ("test_plan_prints_sbatch_lines_that_pretrain_gpt_accepts",
                     "test_mixture_of_experts_prices_experts_by_ep_and_the_plan_searches_it"),
    "test_moe.py": ("test_a_checkpoint_written_at_ep2_resumes_at_ep1_and_at_ep2_tp2",),
    "test_quiet.py": ("test_two_ranks_print_each_expected_warning_once",),
    "test_rule.py": ("test_a_run_warns_once_per_job",),
    "test_slurm.py": ("test_a_bare_srun_runs_each_task_as_a_rank_of_the_job",
                      "test_one_job_per_cluster_meets_at_a_common_rendezvous",
                      "test_one_job_runs_each_worker_as_a_job_step",
                      "test_usr1_checkpoints_requeues_and_the_rerun_resumes"),
    "test_streaming_transport.py": ("test_chunked_wire_carries_what_the_collectives_carry",
                                    "test_transport_times_out_naming_step_tag_and_peers"),
    "test_tokenizers.py": ("test_jsonl_preprocessing_as_megatron_names_it",
                           "test_malformed_jsonl_is_one_line_naming_file_and_line",
                           "test_toy_llama_trains_on_gpt2_bpe_jsonl_data"),
    "test_door.py": ("test_mismatched_launches_stop_every_worker_naming_the_flags",),
    "test_topology.py": ("test_topology_creates_real_groups_on_8_gloo_ranks",),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name in QUICK_FILES and item.originalname not in QUICK_LEFT_OUT.get(name, ()):
            item.add_marker(pytest.mark.quick)
