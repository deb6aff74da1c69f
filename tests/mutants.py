"""A small mutation check over the modules where a wrong answer loses work or time: checkpoint (and its
seal), resume,
failures, gpus, strategy, preemption, run dirs, process lifetime, binding, exit codes, the compile
decision and the decoded-data cache.

Each mutant is a one-line bug put into the source; the tests that should notice it run against it; a
mutant is *caught* when they fail. The file is restored afterwards, whatever happens.

    python -m tests.mutants                 # all mutants; one JSON line each, then a summary line
    python -m tests.mutants atomic idle     # only the mutants whose name contains one of these words

It edits the working tree in place (launcher/ and recipes/ are installed in editable mode, so a copy
would not be what the tests import): run it on a clean checkout, with nothing else running tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


UNIT_CKPT = "tests/unit/test_checkpoint_and_env.py"
UNIT_PLAN = "tests/unit/test_plan.py"
UNIT_COMPILE = "tests/unit/test_compile_and_cache.py"

MUTANTS = [
    Mutant("checkpoint write not atomic", "launcher/train/checkpoint.py",
           "write_atomic(path, lambda f: torch.save(state, f), durable=True)", "torch.save(state, path)", (UNIT_CKPT,)),
    Mutant("snapshot aliases the weights", "launcher/train/checkpoint.py",
           "            if obj.device.type != \"cuda\":\n                return obj.detach().clone()",
           "            if obj.device.type != \"cuda\":\n                return obj.detach()", (UNIT_CKPT,)),
    Mutant("resume= is a no-op", "launcher/train/loop.py",
           "source = str(own) if mine else self.spec.resume_from",
           "source = str(own) if mine else None",
           ("tests/distributed/test_resume.py::test_a_resume_trains_with_the_new_settings_and_records_them",)),
    Mutant("resume keeps the checkpoint's hyper-parameters", "launcher/train/loop.py",
           "optim.continue_with(self.steppers, settings, epoch * self.steps_per_epoch + step)", "pass",
           ("tests/distributed/test_resume.py::test_a_resume_trains_with_the_new_settings_and_records_them",)),
    Mutant("resume allows epochs already trained", "launcher/host/resume.py",
           "if cfg.epochs <= epoch:", "if cfg.epochs < epoch:",
           ("tests/distributed/test_resume.py::test_what_a_checkpoint_cannot_continue_under_is_refused",)),
    Mutant("gpus=N prefers the least free memory", "launcher/host/gpus.py",
           "(1 + g.busy, -round(g.free_gib, 1), g.util_pct, g.index)",
           "(1 + g.busy, round(g.free_gib, 1), g.util_pct, g.index)", (UNIT_PLAN,)),
    Mutant("idle ignores utilization", "launcher/host/gpus.py",
           "< IDLE_USED_GIB and self.util_pct <= IDLE_UTIL_PCT", "< IDLE_USED_GIB", (UNIT_PLAN,)),
    Mutant("a user's strategy.backend ignored", "launcher/strategies/ddp.py",
           "        if chosen is ProcessGroupBackend.auto:", "        if True:", (UNIT_PLAN,)),
    Mutant("max_requeues off by one", "launcher/train/preemption.py",
           "if policy.restart_count >= policy.max_requeues:", "if policy.restart_count > policy.max_requeues:",
           (UNIT_CKPT,)),
    Mutant("root cause: the latest failure, not the earliest", "launcher/failures.py",
           "return min(primary or latest, key=lambda r: r.time)", "return max(primary or latest, key=lambda r: r.time)",
           ("tests/unit/test_failures.py",)),
    Mutant("signal deaths lose their signal", "launcher/host/outcome.py",
           "return 128 - returncode if returncode < 0 else returncode", "return returncode if returncode < 0 else 0",
           ("tests/distributed/test_nothing_silent.py::test_a_sweep_whose_run_is_killed_by_a_signal_exits_128_plus_n",)),
    Mutant("run dir claim not exclusive", "launcher/host/rundir.py",
           "os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644", "os.O_WRONLY | os.O_CREAT, 0o644",
           ("tests/unit/test_rundir.py", "tests/cli/test_run_dirs.py::test_two_launches_started_together_on_one_dir_"
            "never_share_it")),
    Mutant("a user's folder is written into", "launcher/host/rundir.py",
           "    if not entries:\n        return None", "    if True:\n        return None",
           ("tests/cli/test_run_dirs.py",)),
    Mutant("a refused launch removes dirs it did not make", "launcher/host/rundir.py",
           "    if taken is None:  # a sweep's", "    if True:  # a sweep's",
           ("tests/cli/test_run_dirs.py::test_a_refused_launch_removes_only_what_it_created",
            "tests/cli/test_run_dirs.py::test_a_refused_launch_into_the_current_folder_keeps_it")),
    Mutant("workers keep torch's SIGINT parent-death signal", "launcher/train/worker.py",
           "    die_with_parent()  # SIGKILL", "    pass  # SIGKILL",
           ("tests/distributed/test_lifetime_and_binding.py::test_launcher_killed_in_a_background_job_of_a_script"
            "_leaves_no_worker",)),
    Mutant("the workers' store listens on every interface", "launcher/host/rendezvous.py",
           "    handler._create_tcp_store_server = lambda addr, port: store\n    return handler", "    return handler",
           ("tests/distributed/test_lifetime_and_binding.py::test_a_local_launch_listens_on_loopback_only",)),
    Mutant("a bad checkpoint reaches the workers", "launcher/host/resume.py",
           "    if (\"net_state_dict\" not in state and \"sharded\" not in state) or \"epoch\" not in state:",
           "    if False:",
           ("tests/distributed/test_resume.py::test_a_file_that_is_not_a_launch_checkpoint_is_named_for_what_it_is",)),
    Mutant("checkpoints written without their seal", "launcher/train/checkpoint.py",
           "    integrity.seal(state, run, folder)", "    pass", (UNIT_CKPT,)),
    Mutant("a checkpoint's changed bytes pass its seal", "launcher/integrity.py",
           "    if state_digest(state) != mark[\"sha256\"]:", "    if False:", (UNIT_CKPT,)),
    Mutant("the seal leaves out the tensors' bytes", "launcher/integrity.py",
           "                parts.extend(raw[i:i + PIECE_BYTES] for i in range(0, len(raw), PIECE_BYTES))",
           "                pass", (UNIT_CKPT,)),
    Mutant("another run's checkpoint passes as this run's", "launcher/integrity.py",
           "        if here is not None and mark.get(\"run\") not in (None, here):", "        if False:", (UNIT_CKPT,)),
    Mutant("a changed shard file passes its seal", "launcher/integrity.py",
           "            if file_digest(file) != digest:", "            if False:",
           ("tests/distributed/test_fsdp.py::test_a_damaged_sharded_checkpoint_is_one_line_before_any_worker",)),
    Mutant("a mute rendezvous holds the node past rdzv_timeout_s", "launcher/host/rendezvous.py",
           "    thread.join(limit_s)", "    thread.join(limit_s * 20)",
           ("tests/multinode/test_two_nodes.py::test_a_rendezvous_that_accepts_and_never_answers_ends_within_rdzv_"
            "timeout_s",)),
    Mutant("nodes with different settings train apart", "launcher/train/nodes.py",
           "            if not _per_node(key) and first.get(key) != settings.get(key):", "            if False:",
           ("tests/unit/test_nodes.py",
            "tests/multinode/test_two_nodes.py::test_nodes_launched_with_different_settings_refuse_in_one_line_on_"
            "every_node")),
    Mutant("a node_rank given twice is not refused", "launcher/host/rendezvous.py",
           "        if sorted(given) != list(range(info.world_size)):", "        if False:",
           ("tests/multinode/test_two_nodes.py::test_a_node_rank_given_twice_stops_every_node_in_one_line",)),
    Mutant("a rendezvous nobody serves is waited for forever", "launcher/host/rendezvous.py",
           "            if time.monotonic() + 0.5 >= deadline:", "            if False:",
           ("tests/multinode/test_two_nodes.py::test_a_rendezvous_nobody_serves_ends_the_node_at_rdzv_timeout_s",)),
    Mutant("launch eval's workers read a live run's checkpoint in place", "launcher/train/loop.py",
           "read = self.spec.evaluate_read or source", "read = source",
           ("tests/distributed/test_fsdp.py::test_eval_of_a_live_sharded_run_reads_the_checkpoint_it_checked_on_"
            "every_rank",)),
    Mutant("a sharded checkpoint's shards are not held with it", "launcher/host/evaluate.py",
           "                _link_files(path.parent / folder, into / folder)", "                pass",
           ("tests/unit/test_eval_pin.py",
            "tests/distributed/test_fsdp.py::test_eval_of_a_live_sharded_run_reads_the_checkpoint_it_checked_on_"
            "every_rank")),
    Mutant("a newer checkpoint pinned unchecked", "launcher/host/evaluate.py",
           "            load_checkpoint(pinned, setting)  #", "            pass  #", ("tests/unit/test_eval_pin.py",)),
    Mutant("launch eval leaves its links behind", "launcher/host/evaluate.py",
           "    shutil.rmtree(into, ignore_errors=True)\n\n\ndef _shard_folder", "    pass\n\n\ndef _shard_folder",
           ("tests/unit/test_eval_pin.py",
            "tests/distributed/test_fsdp.py::test_eval_of_a_live_sharded_run_reads_the_checkpoint_it_checked_on_"
            "every_rank")),
    Mutant("compile auto compiles before the first step", "launcher/train/compiling.py",
           'return Decision(False, "perf.compile=auto: a run of one epoch", pending=True)',
           'return Decision(True, "perf.compile=auto: a run of one epoch", pending=True)', (UNIT_COMPILE,)),
    Mutant("the data cache ignores a changed source", "launcher/datacache.py",
           'digest.update(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode())',
           'digest.update(f"{path.resolve()}".encode())', (UNIT_COMPILE,)),
    Mutant("evaluation runs the compiled model", "launcher/train/compiling.py",
           "return fast(*args, **kwargs) if model.training else eager(*args, **kwargs)",
           "return fast(*args, **kwargs)", (UNIT_COMPILE,)),
    Mutant("fast net's global max back to torch.amax", "recipes/vision_models.py",
           "x = x.flatten(2).max(dim=2).values", "x = torch.amax(x, dim=(2, 3))",
           (UNIT_COMPILE + "::test_the_fast_net_compiled_by_inductor_under_bf16_keeps_finite_gradients",)),
    # --- h2: the data paths ---
    Mutant("h2 imagefolder reads a linked image twice", "recipes/imagefolder.py",
           "        if there or real in self.linked_files:", "        if real in self.linked_files:",
           ("tests/unit/test_imagefolder.py::test_linked_folders_are_followed_once_and_loops_and_second_paths_are_"
            "left_out_and_said",)),
    Mutant("h2 imagefolder class folders compared by count", "recipes/imagefolder.py",
           "    if train != val:", "    if len(train) != len(val):",
           ("tests/unit/test_imagefolder.py::test_class_folders_that_count_alike_but_differ_by_name_are_refused",)),
    Mutant("h2 imagefolder: a folder it cannot list is a traceback", "recipes/imagefolder.py",
           "        except OSError as exc:  # (os.walk passed over", "        except FileNotFoundError as exc:  # (",
           ("tests/unit/test_imagefolder.py::test_a_folder_that_cannot_be_listed_is_one_line_naming_it",)),
    Mutant("h2 text corpus reads a second path again", "recipes/text.py",
           "        if key in kept:", "        if False:",
           ("tests/unit/test_text_recipe.py::test_a_folder_reads_each_file_once_and_says_what_second_paths_it_left_"
            "out",)),
    Mutant("h2 token id equal to vocab_size accepted", "recipes/token_shards.py",
           "        if largest >= vocab:", "        if largest > vocab:",
           ("tests/unit/test_token_shards.py::test_a_token_id_equal_to_the_vocabulary_size_is_refused_and_one_below_"
            "is_not",)),
    Mutant("h2 stream: every rank the same share", "launcher/train/loader.py",
           "if i % self.world_size == self.rank and (i // self.world_size // self.batch) % workers == worker:",
           "if i % self.world_size == 0 and (i // self.world_size // self.batch) % workers == worker:",
           ("tests/unit/test_own_datasets.py",)),
    Mutant("h2 stream: workers not split", "launcher/train/loader.py",
           "if i % self.world_size == self.rank and (i // self.world_size // self.batch) % workers == worker:",
           "if i % self.world_size == self.rank:", ("tests/unit/test_own_datasets.py",)),
    Mutant("h2 stream: the last partial share dropped", "launcher/train/loader.py",
           "self.loader = DataLoader(self.shard, batch_size=max(1, per_rank_batch), **common)",
           "self.loader = DataLoader(self.shard, batch_size=max(1, per_rank_batch), drop_last=True, **common)",
           ("tests/unit/test_own_datasets.py",)),
    Mutant("h2 stream: workers never told the epoch", "launcher/train/loader.py",
           "        if self.tell and epoch >= 0:", "        if False:", ("tests/unit/test_own_datasets.py",)),
    Mutant("h2 stream: a resumed epoch trains the stream's start again", "launcher/train/loader.py",
           "skip=max(0, whole - len(rows))", "skip=0", ("tests/unit/test_own_datasets.py",)),
    Mutant("h2 evaluation: batch means not weighed by their samples", "launcher/train/step.py",
           "            pair[0].add_(value.double() * n)\n            pair[1].add_(n)",
           "            pair[0].add_(value.double())\n            pair[1].add_(1)",
           ("tests/unit/test_own_datasets.py::test_an_evaluations_batch_means_are_weighed_by_their_samples_over_an_"
            "uneven_last_chunk",)),
]


def run(mutant: Mutant) -> dict:
    path = REPO / mutant.path
    original = path.read_text()
    if original.count(mutant.old) != 1:
        return {"mutant": mutant.name, "caught": None, "error": f"the line is not in {mutant.path} exactly once"}
    started = time.monotonic()
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
                              cwd=REPO, capture_output=True, text=True, timeout=900)
    finally:
        path.write_text(original)
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"mutant": mutant.name, "file": mutant.path, "caught": proc.returncode != 0, "tests": tail,
            "seconds": round(time.monotonic() - started, 1)}


def main(words: list[str]) -> int:
    chosen = [m for m in MUTANTS if not words or any(w.lower() in m.name.lower() for w in words)]
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *sorted({m.path for m in chosen})], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        print(f"mutants: these files have uncommitted changes; commit or stash them first:\n{dirty}", file=sys.stderr)
        return 2
    caught = 0
    for mutant in chosen:
        row = run(mutant)
        caught += bool(row["caught"])
        print(json.dumps(row), flush=True)
    print(json.dumps({"caught": caught, "of": len(chosen)}))
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
