"""The default run's sample of the most parametrized tests' cases (SAMPLED_ONE_IN, tests/conftest.py)."""

import ast
import types
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

    def __init__(self, file: str, test: str, params: dict, slow: bool = False):
        self.path, self.originalname = Path(file), test
        self.name = f"{test}[{'-'.join(map(str, params.values()))}]"
        self.callspec = types.SimpleNamespace(params=params)
        self.markers = ["slow"] if slow else []

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, marker):
        self.markers.append(marker.name)


def test_about_one_case_in_n_stays_with_every_parameter_value_and_the_rest_are_marked_slow():
    """About one in n of a sampled test's cases stay, the same ones every time, among them a case of every value of
    every parameter; cases already slow, and other tests' cases, are left as they were."""
    test = next(iter(conftest.SAMPLED_ONE_IN))
    file, name = test.split("::")
    one_in = conftest.SAMPLED_ONE_IN[test]
    names, dtypes = [f"case{i}" for i in range(60 * one_in)], ["float32", "bfloat16", "float16"]

    def collect():
        cases = [FakeCase(file, name, dict(name=case, dtype=dtype)) for case in names for dtype in dtypes]
        rare = FakeCase(file, name, dict(name="rare", dtype="float64"))  # the only case of its values
        return [*cases, rare], FakeCase(file, name, dict(name="already"), slow=True), FakeCase(file, "test_other", {})

    cases, already, other = collect()
    conftest.mark_unsampled_cases_slow([*cases, already, other])
    taken = [case for case in cases if "slow" not in case.markers]
    assert len(cases) / one_in <= len(taken) <= 2 * len(cases) / one_in, len(taken)
    assert {case.callspec.params["name"] for case in taken} == {*names, "rare"}
    assert {case.callspec.params["dtype"] for case in taken} == {*dtypes, "float64"}
    assert already.markers == ["slow"] and other.markers == []
    again, _, _ = collect()
    conftest.mark_unsampled_cases_slow(again)
    assert [case.name for case in again if "slow" not in case.markers] == [case.name for case in taken]
