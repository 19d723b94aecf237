"""The documentation a clone has: the contract is in the repo, and nothing points outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Files that still cite the design notes that lived outside the repo, owned by others: each
#: should point to docs/contract.md instead (remove it from here when it does).


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def test_no_reference_to_design_notes_outside_the_repo():
    citing = set()
    for path in _tracked_files():
        if path.suffix not in (".py", ".md", ".toml", ".cfg", ".txt", ".yaml", ".sh", ""):
            continue
        if re.search(r"\b(DESIGN|ENVIRONMENT)\.md\b", path.read_text(errors="replace")):
            citing.add(str(path.relative_to(ROOT)))
    assert not citing, f"cite the design notes outside the repo: {sorted(citing)}"


def test_contract_document_covers_the_contract():
    text = (ROOT / "docs" / "contract.md").read_text()
    for heading in ("Format and packing", "The quantizer, in order", "Which amax",
                    "The W4A4 linear and its epilogue", "Accumulation order",
                    "Learner-only parts", "Recipe fingerprint", "What each mode promises",
                    "CPU machines"):  # fmt: skip
        assert re.search(rf"^## \d+\. {re.escape(heading)}", text, re.M), heading
    from minite_common import DEFAULT_RECIPE

    assert DEFAULT_RECIPE.fingerprint() in text  # the stated fingerprint is the real one
    from minite.alignment import CPU_ENGINE_ENV

    for key, value in CPU_ENGINE_ENV.items():
        if key.startswith("VLLM_") or key == "HF_HUB_OFFLINE":
            assert f"{key}={value}" in text, key


def test_relative_links_in_readme_and_docs_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"
