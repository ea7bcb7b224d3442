"""Run the project on a machine without internet whose Python already has PyTorch: fetch only what
it lacks.

Many GPU clusters and rented GPU boxes come with a python3 that holds torch, accelerate and
transformers, and no network. Installing the project there the usual way fails (pip cannot reach the
index) or, online, downloads gigabytes that are already there. Instead:

    # 1. on the GPU machine, from the checkout (standard library only, nothing to install):
    python3 -m recipe_tools.wheelhouse describe > target.json
    # 2. on any machine with internet, from the checkout (what gpu-check needs, DeepSpeed included):
    make wheelhouse TARGET_ENV=target.json   # or: python3 -m recipe_tools.wheelhouse download target.json
    # 3. copy wheelhouse/ to the GPU machine, then there (the line is also in wheelhouse/INSTALL.txt):
    python3 -m pip install --no-index --find-links wheelhouse -r wheelhouse/requirements.txt
    make gpu-check PYTHON_ENV=system                  # every make target runs with python3 as it is, no venv

`download` resolves the project's requirements (and the extras asked for) for the target's Python
version and platform with the target's installed packages pinned as constraints, so everything the
target has stays as it is, and downloads only the wheels of what it lacks. `check` tells whether
this interpreter has what the project needs.
"""

import argparse
import json
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what `check` asks of an interpreter by default: the CIFAR, text and detect recipes
DEFAULT_EXTRAS = "text,detect"
# What `download` fetches by default: everything gpu-check runs, the chat recipe (peft, gguf) and
# DeepSpeed (a py3-none-any wheel, with hjson, which
# PyTorch images lack) included; add dev for the tests.
DOWNLOAD_EXTRAS = "text,detect,chat,deepspeed"


class WheelhouseError(Exception):
    pass


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ----------------------------------------------------------------------------------------- describe
def platform_tags(system: str, machine: str, glibc: str | None) -> list[str]:
    """The wheel platform tags a Linux machine accepts (pip matches --platform exactly, so all of
    them)."""
    if system != "Linux":
        return [sysconfig.get_platform().replace("-", "_").replace(".", "_")]
    tags = []
    if glibc:
        major, minor = (int(part) for part in glibc.split(".")[:2])
        tags += [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        tags += [f"{name}_{machine}" for m, name in legacy.items() if major == 2 and minor >= m]
    return tags + [f"linux_{machine}"]


def describe() -> dict:
    """This interpreter: version, implementation, platform tags and installed distributions."""
    libc, version = platform.libc_ver()
    packages = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            packages[normalise(name)] = dist.version
    return {
        "python_version": f"{sys.version_info.major}.{sys.version_info.minor}",
        "implementation": "cp" if sys.implementation.name == "cpython" else sys.implementation.name,
        "platforms": platform_tags(
            platform.system(), platform.machine(), version if libc == "glibc" else None
        ),
        "executable": sys.executable,
        "packages": dict(sorted(packages.items())),
    }


# ------------------------------------------------------------------------------------- requirements
def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
        from pip._vendor import tomli as tomllib
    return tomllib.loads(path.read_text())


def _packaging():
    try:
        from packaging.requirements import Requirement
    except ModuleNotFoundError:
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def project_requirements(extras: list[str], pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The runtime dependencies plus those of EXTRAS, as written in pyproject.toml (self-references
    expanded)."""
    Requirement = _packaging()
    project = _toml(pyproject)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise WheelhouseError(f"unknown extra(s) {', '.join(unknown)}; choose from {', '.join(optional)}")
    wanted, seen, todo = list(project["dependencies"]), set(), list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in optional[extra]:
            requirement = Requirement(line)
            if normalise(requirement.name) == normalise(project["name"]):
                todo += list(requirement.extras)
            else:
                wanted.append(line)
    return list(dict.fromkeys(wanted))


def missing_requirements(requirements: list[str], installed: dict[str, str]) -> list[str]:
    """The requirements INSTALLED does not satisfy (absent, or a version outside the specifier)."""
    Requirement = _packaging()
    missing = []
    for line in requirements:
        requirement = Requirement(line)
        version = installed.get(normalise(requirement.name))
        if version is None or not requirement.specifier.contains(version.split("+")[0], prereleases=True):
            missing.append(line)
    return missing


# ----------------------------------------------------------------------------------------- download
def pip_platform_args(target: dict) -> list[str]:
    args = [
        "--only-binary=:all:",
        "--python-version",
        target["python_version"],
        "--implementation",
        target.get("implementation", "cp"),
    ]
    for tag in target["platforms"]:
        args += ["--platform", tag]
    return args


def download(target: dict, extras: list[str], out: Path, also: list[str]) -> list[str]:
    """Download into OUT the wheels TARGET lacks for the project; returns their `name==version`
    pins."""
    installed = target["packages"]
    needed = missing_requirements(project_requirements(extras), installed) + also
    out.mkdir(parents=True, exist_ok=True)
    if not needed:
        (out / "requirements.txt").write_text("")
        return []
    with tempfile.TemporaryDirectory() as tmp:
        # The target's packages pinned as constraints: dependencies it has are kept at its versions
        # (local labels such as +cu130 dropped: the index's build of the same version stands in for
        # resolving), and so never downloaded.
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(
            "".join(
                f"{name}=={version.split('+')[0]}\n"
                for name, version in installed.items()
                if re.fullmatch(r"[0-9][0-9A-Za-z.!]*", version.split("+")[0])
            )
        )
        report = Path(tmp) / "report.json"
        resolve = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--target",
            str(Path(tmp) / "never"),
            *pip_platform_args(target),
            "-c",
            str(constraints),
            *needed,
        ]
        proc = subprocess.run(resolve, capture_output=True, text=True)
        if proc.returncode:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")] or [
                proc.stderr.strip()
            ]
            raise WheelhouseError(
                f"pip could not resolve {' '.join(needed)} for Python {target['python_version']} "
                f"on {target['platforms'][0]}: {errors[-1]}"
            )
        resolved = json.loads(report.read_text())["install"]
    pins = sorted(
        f"{item['metadata']['name']}=={item['metadata']['version']}"
        for item in resolved
        if normalise(item["metadata"]["name"]) not in installed
    )
    if pins:
        fetch = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--dest",
            str(out),
            *pip_platform_args(target),
            *pins,
        ]
        proc = subprocess.run(fetch, capture_output=True, text=True)
        if proc.returncode:
            raise WheelhouseError(f"pip download failed: {proc.stderr.strip().splitlines()[-1]}")
    (out / "requirements.txt").write_text("".join(pin + "\n" for pin in pins))
    return pins


def install_lines(out: str) -> str:
    return (
        f"python3 -m pip install --no-index --find-links {out} -r {out}/requirements.txt\n"
        f"# or, where that Python's site-packages is read-only:\n"
        f"python3 -m pip install --no-index --no-deps --target ~/.accelerate-recipes-site {out}/*.whl\n"
        f"export PYTHONPATH=~/.accelerate-recipes-site\n"
    )


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe_tools.wheelhouse",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "describe", help="print this interpreter's Python version, platform and packages as JSON"
    )
    get = commands.add_parser("download", help="on a connected machine: the wheels a described target lacks")
    get.add_argument("target", help="the JSON `describe` printed on the target machine")
    get.add_argument(
        "--extras",
        default=DOWNLOAD_EXTRAS,
        help=f"the project's extras to cover, comma-separated (default {DOWNLOAD_EXTRAS}; '' for none)",
    )
    get.add_argument("--also", default="", help="more requirements, comma-separated (e.g. 'gguf==0.19.0')")
    get.add_argument("--out", default="wheelhouse", help="folder for the wheels (default wheelhouse)")
    check = commands.add_parser("check", help="exit 1 naming what this interpreter lacks for the project")
    check.add_argument(
        "--extras", default=DEFAULT_EXTRAS, help=f"extras to check too (default {DEFAULT_EXTRAS})"
    )
    args = parser.parse_args(argv)

    def split(text):
        return [item.strip() for item in text.split(",") if item.strip()]

    try:
        if args.command == "describe":
            print(json.dumps(describe(), indent=1))
        elif args.command == "check":
            missing = missing_requirements(project_requirements(split(args.extras)), describe()["packages"])
            if missing:
                raise WheelhouseError(
                    f"{sys.executable} lacks {', '.join(missing)}: install them (offline: "
                    "python3 -m recipe_tools.wheelhouse --help), or use PYTHON_ENV=venv"
                )
            print(f"{sys.executable} has every requirement of the project (extras: {args.extras or 'none'})")
        else:
            path = Path(args.target)
            if not path.is_file():
                raise WheelhouseError(
                    f"{path} not found: write it on the target machine with "
                    "`python3 -m recipe_tools.wheelhouse describe > target.json`"
                )
            try:
                target = json.loads(path.read_text())
                target["python_version"], target["platforms"], target["packages"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise WheelhouseError(
                    f"{path} is not the output of `recipe_tools.wheelhouse describe` ({err}); "
                    "write it again on the target machine"
                ) from None
            print(
                f"resolving for Python {target['python_version']} on {target['platforms'][0]} "
                f"({len(target['packages'])} packages there already) ...",
                flush=True,
            )
            pins = download(target, split(args.extras), Path(args.out), split(args.also))
            if not pins:
                print("the target has everything the project needs; nothing to download")
                return 0
            (Path(args.out) / "INSTALL.txt").write_text(install_lines(args.out))
            print(
                f"{len(pins)} wheels in {args.out}/: {', '.join(pins)}\n"
                f"copy {args.out}/ to the target and install there, without network:\n"
                + install_lines(args.out)
            )
    except WheelhouseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
