"""Mutants of launcher/train/: what a worker runs."""

from tests.mutants import UNIT_CKPT, UNIT_COMPILE, Mutant

MUTANTS = [
    Mutant("checkpoint write not atomic", "launcher/train/checkpoint.py",
           "write_atomic(path, lambda f: torch.save(state, f), durable=True)", "torch.save(state, path)", (UNIT_CKPT,)),
    Mutant("snapshot aliases the weights", "launcher/train/checkpoint.py",
           "        if t.device.type != \"cuda\":\n            return t.detach().clone()",
           "        if t.device.type != \"cuda\":\n            return t.detach()", (UNIT_CKPT,)),
    Mutant("resume= is a no-op", "launcher/train/loop.py",
           "source = str(own) if mine else self.spec.resume_from",
           "source = str(own) if mine else None",
           ("tests/distributed/test_resume.py::test_a_resume_trains_with_the_new_settings_and_records_them",)),
    Mutant("resume keeps the checkpoint's hyper-parameters", "launcher/train/loop.py",
           "optim.continue_with(self.steppers, settings, epoch * self.steps_per_epoch + step)", "pass",
           ("tests/distributed/test_resume.py::test_a_resume_trains_with_the_new_settings_and_records_them",)),
    Mutant("max_requeues off by one", "launcher/train/preemption.py",
           "if policy.restart_count >= policy.max_requeues:", "if policy.restart_count > policy.max_requeues:",
           (UNIT_CKPT,)),
    Mutant("workers keep torch's SIGINT parent-death signal", "launcher/train/worker.py",
           "    die_with_parent()  # SIGKILL", "    pass  # SIGKILL",
           ("tests/distributed/test_lifetime_and_binding.py::test_launcher_killed_in_a_background_job_of_a_script"
            "_leaves_no_worker",)),
    Mutant("checkpoints written without their seal", "launcher/train/checkpoint.py",
           "    integrity.seal(state, run, folder)", "    pass", (UNIT_CKPT,)),
    Mutant("nodes with different settings train apart", "launcher/train/nodes.py",
           "            if not _per_node(key) and first.get(key) != settings.get(key):", "            if False:",
           ("tests/unit/test_nodes.py",
            "tests/multinode/test_two_nodes.py::test_nodes_launched_with_different_settings_refuse_in_one_line_on_"
            "every_node")),
    Mutant("launch eval's workers read a live run's checkpoint in place", "launcher/train/loop.py",
           "read = self.spec.evaluate_read or source", "read = source",
           ("tests/distributed/test_fsdp.py::test_eval_of_a_live_sharded_run_reads_the_checkpoint_it_checked_on_"
            "every_rank",)),
    Mutant("compile auto compiles before the first step", "launcher/train/compiling.py",
           'return Decision(False, "perf.compile=auto: a run of one epoch", pending=True)',
           'return Decision(True, "perf.compile=auto: a run of one epoch", pending=True)', (UNIT_COMPILE,)),
    Mutant("evaluation runs the compiled model", "launcher/train/compiling.py",
           "return fast(*args, **kwargs) if model.training else eager(*args, **kwargs)",
           "return fast(*args, **kwargs)", (UNIT_COMPILE,)),
]
