"""The vision recipes' steps: CIFAR's fast94 preset on 50,000 generated images, the detector at 640
px."""

from ..paths import RECIPES
from ..run_outputs import epoch_seconds, key_figures, read_json
from ..runner import StepRunner


class VisionSteps(StepRunner):
    """fast94 and detect-640: the CIFAR and detector recipes at full size on one device."""

    def fast94(self, run_dir, timeout):
        sizes = (
            ["--synthetic_size", "128", "--batch_size", "32", "--epochs", "1"]
            if self.quick
            else ["--synthetic_size", "50000", "--epochs", "2"]
        )
        command = [
            *self.single(),
            RECIPES / "cifar.py",
            "--preset",
            "fast94",
            "--dataset",
            "synthetic",
            *sizes,
            "--tracker",
            "none",
            "--num_workers",
            "0",
            "--checkpoint_every",
            "0",
            "--output_dir",
            run_dir,
        ]

        def figures(d):
            results = read_json(d / "results.json")
            return {
                **key_figures(
                    results,
                    "loader",
                    "global_batch_size",
                    "mixed_precision",
                    "steps",
                    "eval_accuracy",
                    "train_samples_per_second",
                    "peak_memory_mb",
                    "wall_seconds",
                ),
                "epoch_seconds": epoch_seconds(d),
                "train_images": results.get("train_size"),
            }

        return self.simple(command, run_dir, timeout, figures)

    def detect(self, run_dir, timeout):
        sizes = (
            ["--synthetic_size", "32", "--image_size", "128", "--batch_size", "8", "--max_steps", "3"]
            if self.quick
            else ["--synthetic_size", "512", "--image_size", "640", "--batch_size", "32", "--epochs", "2"]
        )
        command = [
            *self.single(),
            RECIPES / "detect" / "train.py",
            "--data",
            "synthetic",
            "--data_dir",
            run_dir / "data",
            *sizes,
            "--tracker",
            "none",
            "--checkpoint_every",
            "0",
            "--output_dir",
            run_dir,
        ]
        if not self.cuda:
            command += ["--num_workers", "0"]
        return self.simple(
            command,
            run_dir,
            timeout,
            lambda d: {
                **key_figures(
                    read_json(d / "results.json"),
                    "image_size",
                    "global_batch_size",
                    "steps",
                    "eval_map50",
                    "eval_map50_95",
                    "train_samples_per_second",
                    "median_step_seconds",
                    "peak_memory_mb",
                    "wall_seconds",
                ),
                "epoch_seconds": epoch_seconds(d),
            },
        )
