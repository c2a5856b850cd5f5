"""Sandboxes: SWE tasks, their Docker images and containers, and grading by tests.

The flow, one module per step (import them directly; this package imports nothing):

    task.py         Task record, load_tasks(path)            (JSONL, local HF datasets)
    base_image.py   build_base_image(connection)             (debootstrap + docker import)
    task_image.py   ensure_task_image(connection, task)      (repo at base commit, one commit)
    connection.py   connect(docker_url) -> Connection        (SDK + its thread pool)
    sandbox.py      Sandbox.start / exec / read_file / write_file / diff / close; gc(run)
    artefacts.py    BUILD_ARTEFACTS                          (bytecode, caches: not in a diff)
    link.py         GatewayRelay, start_linked_sandbox        (the gateway is the only peer)
    task_setup.py   prepare_session_sandbox, run_start_commands  (each set-up field where the
                    official harnesses run it; the session's sandbox.log)
    grading.py      grade(connection, task, diff) -> Grade   (fresh container, tests, reward)
                    judge(task, log) -> Verdict              (the official harness's rules)
    log_parsers.py  LOG_PARSERS by name                      (pytest first)
    swebench_harness.py  the `swebench` package's specs, parsers and grader, where it knows
                    the repository (optional extra `undertow[swebench]`)
    datasets/       SWE-bench, SWE-Gym, SWE-smith, R2E-Gym, SWE-rebench rows -> task sets
                    (`undertow tasks import`), image names and how to get them
    taskset.py      stamp_task_set / check_stamps            (shipped task sets' base commits)
    validation.py   validate_tasks                           (`undertow tasks validate`)
    errors.py       SandboxError and its subclasses
"""
