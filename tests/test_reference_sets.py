"""The committed reference sets (artifacts/reference/<gpu>/) are whole: a set is every table, the
claims check, the figures, the calibration and its repeat, the benchmarks and the job logs of one
run at one commit, each file naming that commit and where it ran. Earlier runs live under
history/, each listed in its index with its commit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pkv.report import headline
from pkv.report import reference_set as rs

REFERENCE = Path(__file__).resolve().parents[1] / "artifacts" / "reference"
SETS = sorted(p.parent for p in REFERENCE.glob("*/tables"))
# What a set holds and the provenance every result records are the promoting command's
# (pkv.report.reference_set); the committed sets also have the README it writes.
TABLES = rs.TABLES
FORMATS = rs.TABLE_FORMATS
REQUIRED = rs.REQUIRED + ("README.md",)
FIGURES = rs.FIGURES
PROVENANCE = rs.PROVENANCE


def test_there_is_a_reference_set():
    assert SETS, f"no reference set (a folder with tables/) under {REFERENCE}"


def _commit_of_tables(root: Path) -> set[str]:
    commits = set()
    for name in TABLES:
        text = (root / "tables" / f"{name}.md").read_text()
        found = re.findall(r"Commit: ([0-9a-f]{12})", text)
        assert found, f"{name}.md names no commit"
        commits.update(found)
    return commits


@pytest.mark.parametrize("root", SETS, ids=[p.name for p in SETS])
def test_a_reference_set_has_every_table_figure_and_record(root):
    missing = [f"tables/{name}.{fmt}" for name in TABLES for fmt in FORMATS
               if not (root / "tables" / f"{name}.{fmt}").is_file()]
    missing += [path for path in REQUIRED if not (root / path).is_file()]
    missing += [f"figures/{name}.png" for name in FIGURES if not (root / "figures" / f"{name}.png").is_file()]
    assert not missing, f"{root.name}: missing {missing}"
    assert (root / "logs").is_dir() and any((root / "logs").rglob("*.log")), f"{root.name}: no job logs"


@pytest.mark.parametrize("root", SETS, ids=[p.name for p in SETS])
def test_every_file_of_a_reference_set_names_one_commit_and_where_it_ran(root):
    commits = _commit_of_tables(root)
    assert len(commits) == 1, f"{root.name}: tables name several commits {sorted(commits)}"
    (commit,) = commits
    files = [p for p in root.rglob("*.json") if "history" not in p.relative_to(root).parts]
    assert files
    for path in files:
        provenance = json.loads(path.read_text()).get("provenance")
        where = path.relative_to(REFERENCE)
        assert isinstance(provenance, dict), f"{where}: no provenance"
        empty = [key for key in PROVENANCE if provenance.get(key) in (None, "")]
        assert not empty, f"{where}: provenance lacks {empty}"
        assert provenance["git_commit"].startswith(commit), f"{where}: commit {provenance['git_commit']}, set {commit}"
        assert provenance["git_dirty"] is False, f"{where}: ran from a dirty tree"
    readme = (root / "README.md").read_text()
    assert commit[:7] in readme, f"{root.name}/README.md does not name commit {commit[:7]}"


@pytest.mark.parametrize("history", sorted(REFERENCE.glob("*/history")), ids=lambda p: p.parent.name)
def test_every_earlier_run_is_in_its_history_index(history):
    index = (history / "README.md").read_text()
    unlisted = [p.name for p in history.iterdir() if p.name != "README.md" and f"`{p.name}" not in index]
    assert not unlisted, f"{history}: not in README.md {unlisted}"


@pytest.mark.parametrize("empty", sorted(p for p in REFERENCE.iterdir() if p.is_dir() and p not in SETS),
                         ids=lambda p: p.name)
def test_a_gpu_without_a_set_points_at_the_current_ones_by_their_commits(empty):
    """A GPU folder that holds no set yet says which set to read instead: every current set's
    commit is named in its README, so a promotion that moves a set cannot leave it pointing at
    the one it replaced."""
    readme = (empty / "README.md").read_text()
    for root in SETS:
        (commit,) = _commit_of_tables(root)
        assert f"../{root.name}/" in readme and commit[:7] in readme, \
            f"{empty.name}/README.md does not name {root.name}'s set at {commit[:7]}"


@pytest.mark.parametrize("root", SETS, ids=[p.name for p in SETS])
def test_the_readme_quotes_each_set_as_the_headline_computes_it(root):
    """The README's figures of a set are pkv.report.headline's, between the set's two markers: a
    promoted set cannot leave the previous set's numbers in the README."""
    readme = REFERENCE.parents[1] / "README.md"
    name = headline.set_name_of(root)
    span = headline.readme_block(readme, name)
    assert span is not None, f"README.md has no headline block for {name}: {headline.markers(name)[0]}"
    assert readme.read_text()[span[0]:span[1]] == headline.headline(root), (
        f"README.md's headline of {name} is stale: python -m pkv.report.headline {name} --write README.md")
