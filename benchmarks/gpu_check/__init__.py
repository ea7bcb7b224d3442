"""`make gpu-check`: one command that proves the GPU paths on this machine's GPUs and writes a
report.

    python benchmarks/gpu_check --help      # the flags, the steps and the verdicts (__main__.py)

The modules, in the order a call uses them:
  __main__.py     the command line: flags checked, then one call (or --merge, or --plan)
  calls.py        one call: the machine recorded, the steps run in order of value within --budget
                  and the free disk, the report after each; --plan's calls printed
  plan.py         the steps, what each needs of the machine and of the disk, the seconds each may
                  take and is expected to take (estimates built from measured parts), and the calls
                  that fit a budget (--plan)
  machine.py      what the report records of the machine: GPUs, driver, versions, tools
  runner.py       how one step runs its commands: a fresh folder, launched as users launch, time
                  limits, its record
  processes.py    process trees started in sessions of their own and stopped whole; the signals that
                  stop gpu-check
  steps/          the steps, one module per family: chat (its figures in chat_figures), vision,
                  text, measurements (bench and the host-read audits), preemption, multi_gpu
  run_outputs.py  what a step reads back from a run's folder, what its time was made of, the weights
                  removed
  report.py       the verdict, report.md and report.json, the logs tar for --results_dir
  proof.py        what a report proves (its key), what --after carries (to GPUs like the proof's
                  too), --merge into docs/gpu-proof.json and .md
  paths.py        where the checkout's recipes, configs and benchmarks lie
"""
