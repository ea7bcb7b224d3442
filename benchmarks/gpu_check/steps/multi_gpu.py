"""The steps that need 2+ GPUs (two gloo processes on the CPU): two nodes' rendezvous and NCCL, DDP
and SyncBN, all-reduce bandwidth, DataParallel against DDP."""

import re
import sys
import time

from ..paths import BENCHMARKS, CONFIGS, RECIPES
from ..processes import free_port
from ..run_outputs import epoch_seconds, key_figures, read_json, tail
from ..runner import StepRunner


class MultiGpuSteps(StepRunner):
    """nccl-doctor, ddp, sync-bn, allreduce and dp-vs-ddp: on 2+ GPUs, or two gloo processes on the
    CPU."""

    def nccl_doctor(self, run_dir, timeout):
        """Two doctor processes on this machine, as two nodes of one GPU each: rendezvous, gloo,
        NCCL all-reduce."""
        port, wait = free_port(), "30" if self.quick or not self.cuda else "60"
        commands = [
            [
                sys.executable,
                "-m",
                "recipe_tools.doctor",
                "--config_file",
                CONFIGS / "2node.yaml",
                "--machine_rank",
                str(rank),
                "--num_machines",
                "2",
                "--num_processes",
                "2",
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                "--timeout",
                wait,
                "--nccl_mb",
                "8" if self.quick else "256",
            ]
            for rank in (0, 1)
        ]
        shown = [" ".join(map(str, c)) for c in commands]
        seconds, which = self.limit(timeout)
        end = time.monotonic() + seconds
        logs = [run_dir / f"rank{rank}.txt" for rank in (0, 1)]
        procs = [
            self.start(command, log, dict(self.env, LOCAL_RANK=str(rank)))
            for rank, (command, log) in enumerate(zip(commands, logs))
        ]
        codes = [self.wait(proc, max(1.0, end - time.monotonic()), which) for proc in procs]
        outputs = [log.read_text(errors="replace") for log in logs]
        nccl = next((line[4:] for line in outputs[0].splitlines() if "NCCL all-reduce" in line), "")
        busbw = re.search(r"busbw ([\d.]+) GB/s", nccl)
        figures = {
            "nccl": nccl,
            "busbw_gbps": float(busbw[1]) if busbw else None,
            "gloo": next((line[4:] for line in outputs[0].splitlines() if "gloo all_reduce" in line), ""),
        }
        passed = all(
            code == 0 and "doctor: all checks passed on 2 node(s)" in out for code, out in zip(codes, outputs)
        )
        if passed and (busbw or not self.cuda):
            return "pass", shown, figures, ""
        limit = f" (stopped after {seconds:.0f} s, {which})" if 124 in codes else ""
        return (
            "fail",
            shown,
            figures,
            "\n".join(
                f"rank {rank}: exit {code}{limit}; last lines:\n{tail(log)}"
                for rank, (code, log) in enumerate(zip(codes, logs))
            ),
        )

    def ddp(self, sync_bn: bool):
        def body(run_dir, timeout):
            processes = self.gpus if self.cuda else 2
            sizes = (
                ["--synthetic_size", "320", "--batch_size", "32", "--max_steps", "4"]
                if not self.cuda or self.quick
                else ["--synthetic_size", "50000", "--batch_size", "512", "--epochs", "1"]
            )
            command = (
                [
                    *self.launch("2gpu", processes),
                    RECIPES / "cifar.py",
                    "--dataset",
                    "synthetic",
                    *sizes,
                    "--tracker",
                    "none",
                    "--checkpoint_every",
                    "0",
                    "--output_dir",
                    run_dir,
                ]
                + (["--sync_bn", "True"] if sync_bn else [])
                + ([] if self.cuda else ["--num_workers", "0"])
            )
            return self.simple(
                command,
                run_dir,
                timeout,
                lambda d: {
                    **key_figures(read_json(d / "results.json")),
                    **key_figures(
                        read_json(d / "results.json"), "sync_bn", "eval_accuracy", "distributed_type"
                    ),
                    "epoch_seconds": epoch_seconds(d),
                },
            )

        return body

    def allreduce(self, run_dir, timeout):
        n = self.gpus if self.cuda else 2
        args = f"--output_dir {run_dir}" + (" --max_bytes 1048576" if self.quick or not self.cuda else "")
        # The target users type, run by this interpreter as it
        # is (PYTHON_ENV=system: no venv, no install step).
        target = (
            f"allreduce-{n}gpu"
            if self.cuda and n in (2, 4, 8)
            else ("allreduce-cpu" if not self.cuda else None)
        )
        if target:
            command = [
                "make",
                "--no-print-directory",
                "PYTHON_ENV=system",
                f"PYTHON={sys.executable}",
                target,
                f"ARGS={args}",
            ] + ([] if self.cuda else ["NPROC=2", "THREADS=1"])
        else:
            command = [*self.launch("2gpu", n), BENCHMARKS / "allreduce.py", *args.split()]

        def figures(d):
            report = read_json(d / "allreduce.json")
            sizes = report.get("sizes", [])
            best = max(sizes, key=lambda r: r.get("busbw_gbps", 0), default={})
            return {
                "world_size": report.get("world_size"),
                "backend": report.get("backend"),
                "largest_bytes": sizes[-1]["bytes"] if sizes else None,
                "best_busbw_gbps": best.get("busbw_gbps"),
                "at_bytes": best.get("bytes"),
            }

        return self.simple(command, run_dir, timeout, figures)

    def dp_vs_ddp(self, run_dir, timeout):
        command = [
            sys.executable,
            BENCHMARKS / "scaling.py",
            "run",
            "--setups",
            f"gpu:1,gpu:{self.gpus},dp:{self.gpus}",
            "--steps",
            "8" if self.quick else "30",
            "--output_dir",
            run_dir,
        ]

        def figures(d):
            rows = read_json(d / "scaling.json").get("rows", [])
            return {
                r["setup"]: {
                    k: r.get(k)
                    for k in (
                        "parallelism",
                        "devices",
                        "samples_per_second",
                        "speedup",
                        "efficiency",
                        "predicted_efficiency",
                    )
                }
                for r in rows
            }

        return self.simple(command, run_dir, timeout, figures)
