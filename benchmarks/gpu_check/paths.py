"""Where the project's pieces lie: the checkout this package sits in, installed or not."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "accelerate_configs"
RECIPES = REPO / "recipes"
BENCHMARKS = REPO / "benchmarks"
