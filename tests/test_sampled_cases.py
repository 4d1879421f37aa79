"""The default run's sample of the most parametrized tests' cases (SAMPLED_ONE_IN, tests/conftest.py)."""

import ast
import zlib
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def parametrized_tests(path: Path) -> set[str]:
    """The names of the test functions in `path` with a parametrize decorator."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and any(
                "parametrize" in ast.unparse(decorator) for decorator in node.decorator_list):
            names.add(node.name)
    return names


def test_every_sampled_test_exists_and_is_parametrized():
    """A renamed test would fall out of the table silently (and run in full): each entry names one."""
    for test, one_in in conftest.SAMPLED_ONE_IN.items():
        file, name = test.split("::")
        assert name in parametrized_tests(TESTS / file), test
        assert isinstance(one_in, int) and one_in >= 2, test


class FakeCase:
    """What mark_unsampled_cases_slow reads of a collected case, and the markers it adds."""

    def __init__(self, file: str, test: str, params: str, slow: bool = False):
        self.path, self.originalname, self.name = Path(file), test, f"{test}[{params}]"
        self.markers = ["slow"] if slow else []

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, marker):
        self.markers.append(marker.name)


def test_one_case_in_n_stays_in_the_default_run_and_the_rest_are_marked_slow():
    """About one in n of a sampled test's cases stay, the same ones every time; cases already slow, and other
    tests' cases, are left as they were; a test whose hash takes no case keeps its first."""
    test = next(iter(conftest.SAMPLED_ONE_IN))
    file, name = test.split("::")
    one_in = conftest.SAMPLED_ONE_IN[test]

    def collect():
        cases = [FakeCase(file, name, f"case{i}") for i in range(100 * one_in)]
        return cases, FakeCase(file, name, "already", slow=True), FakeCase(file, "test_other", "x")

    cases, already, other = collect()
    conftest.mark_unsampled_cases_slow([*cases, already, other])
    taken = [case.name for case in cases if "slow" not in case.markers]
    assert 50 <= len(taken) <= 150, len(taken)
    assert already.markers == ["slow"] and other.markers == []
    again, _, _ = collect()
    conftest.mark_unsampled_cases_slow(again)
    assert [case.name for case in again if "slow" not in case.markers] == taken
    outside = next(f"case{i}" for i in range(1000) if zlib.crc32(f"{name}[case{i}]".encode()) % one_in)
    lone = FakeCase(file, name, outside)  # the only case of its test, outside the sample: it still runs
    conftest.mark_unsampled_cases_slow([lone])
    assert lone.markers == []
