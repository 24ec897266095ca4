"""scripts/benchmarks/bench_memory.py's arithmetic on measured timelines: the largest total of all processes at once, and each
two-process case's memory at start put against the one-process case of its own model size (no model loaded)."""

from __future__ import annotations

from file_modules import import_file

bench = import_file("scripts/benchmarks/bench_memory.py")


def test_the_peak_of_the_sum_is_taken_at_one_moment_not_each_process_at_its_own_peak():
    main = [(0.0, 10, 5), (1.0, 50, 25), (2.0, 20, 10)]  # (time, resident, proportional)
    other = [(0.5, 30, 15), (2.5, 40, 20)]  # its peak, 40, comes after the main process's has passed
    assert bench.peak_of_sum([main, other]) == 50 + 30
    assert bench.peak_of_sum([main, other], column=2) == 25 + 15


def case(name: str, start_sum: int, processes: int) -> dict:
    return {"case": name, "measured": [1] * processes, "start_sum": start_sum, "start_sum_pss": start_sum // 2,
            "phases": {"load": {"predicted": [100] * processes}}}


def test_each_two_process_case_is_put_against_the_single_process_of_its_size():
    results = {"cases": [case("recipe-single-all", 1000, 1), case("start1b-single-norms", 8000, 1),
                         case("recipe-fsdp2-all", 1300, 2), case("start1b-fsdp2-norms", 8800, 2)]}
    bench.start_ratios(results)
    by_name = {c["case"]: c for c in results["cases"]}
    assert by_name["recipe-fsdp2-all"]["start_ratio"] == 1.3
    assert by_name["start1b-fsdp2-norms"]["start_ratio"] == 1.1
    assert by_name["start1b-fsdp2-norms"]["start_ratio_pss"] == 1.1
    assert "start_ratio" not in by_name["recipe-single-all"]
    assert by_name["start1b-fsdp2-norms"]["start_predicted"] == 200


def test_a_size_without_its_single_process_case_gets_no_ratio():
    results = {"cases": [case("recipe-single-all", 1000, 1), case("start1b-fsdp2-norms", 8800, 2)]}
    bench.start_ratios(results)
    assert "start_ratio" not in results["cases"][1]
