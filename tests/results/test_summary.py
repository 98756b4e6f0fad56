"""The conformance summary groups failures and skips by their cause."""

from __future__ import annotations

from dsconform.results.records import Outcome
from dsconform.results.summary import case_id, group, lines, reason_key, summarize

ZERO = "suites/test_zero.py::test_zero_matches_ddp"


def _z0(cell: str, rel: str, grad: str = "0.0123") -> tuple[str, str]:
    nodeid = f"{ZERO}[{cell}]"
    return nodeid, (f"{cell}: first diverging step 0: step 0, grad of 'fc1.weight' (rank 0): "
                    f"max abs diff {grad}, max rel diff {rel} exceeds tolerance rtol=0.001 "
                    f"atol=0.001 (fp16 SGD on GPUs)")


def test_twelve_failures_with_one_cause_are_one_line_with_their_cases():
    cells = [f"cuda-z0-off_none-fp16-{opt}-gas{g}-ws{w}" for opt in ("sgd", "adam", "fused_adam")
             for g in (1, 4) for w in (1, 2)]
    entries = [_z0(c, f"0.99{i}", f"0.0{i}1") for i, c in enumerate(cells)]
    entries.append(("suites/test_profile.py::test_gpu_count", "expected 2 GPUs, found 1"))
    [zero, other] = group(entries)
    assert zero["count"] == 12 and other["count"] == 1
    assert zero["reason"].startswith("first diverging step 0: step 0, grad of 'fc1.weight'")
    assert cells[0] not in zero["reason"]
    out = lines({"capabilities": {"zero": {"failed": 12}}, "failures": [zero, other],
                 "skips": [], "known_issues": []}, profile="h200-x2", host="n1")
    i = next(i for i, ln in enumerate(out) if ln.startswith("    12 x first diverging"))
    assert out[i + 1].startswith("         cases: cuda-z0-off_none-fp16-sgd-gas1-ws1, ")
    assert out[i + 1].endswith(", ... 4 more")
    assert "     1 x expected 2 GPUs, found 1" in out


def test_cases_of_several_tests_are_named_with_their_test():
    """One cause across tests: a bare "bf16" would not say which test it was."""
    entries = [("suites/test_profile.py::test_gpu_count", "GPUs not usable"),
               ("suites/test_profile.py::test_half_precision_matmul[bf16]", "GPUs not usable"),
               ("suites/test_profile.py::test_half_precision_matmul[fp16]", "GPUs not usable")]
    out = lines({"capabilities": {"profile": {"failed": 3}}, "failures": group(entries),
                 "skips": [], "known_issues": []}, profile="p", host="n1")
    assert ("         cases: test_gpu_count, test_half_precision_matmul[bf16], "
            "test_half_precision_matmul[fp16]") in out


def test_tests_of_one_name_in_two_files_are_named_with_their_file():
    entries = [("suites/test_zero.py::test_effective_defaults", "DeepSpeed moved a default"),
               ("suites/test_multinode.py::test_effective_defaults", "DeepSpeed moved a default"),
               ("suites/test_profile.py::test_gpu_count", "DeepSpeed moved a default")]
    out = lines({"capabilities": {"zero": {"failed": 3}}, "failures": group(entries),
                 "skips": [], "known_issues": []}, profile="p", host="n1")
    assert ("         cases: test_zero.py::test_effective_defaults, "
            "test_multinode.py::test_effective_defaults, test_gpu_count") in out
    # The same test in two files, and nothing else: not a bare case id either.
    out = lines({"capabilities": {"zero": {"failed": 2}}, "failures": group(entries[:2]),
                 "skips": [], "known_issues": []}, profile="p", host="n1")
    assert ("         cases: test_zero.py::test_effective_defaults, "
            "test_multinode.py::test_effective_defaults") in out


def test_different_causes_stay_apart():
    a = _z0("cuda-z0-off_none-fp16-sgd-gas1-ws2", "0.999")
    b = (f"{ZERO}[cuda-z1-off_none-bf16-sgd-gas1-ws2]",
         "cuda-z1-off_none-bf16-sgd-gas1-ws2: first diverging step 5: step 5, loss (rank 1): "
         "max abs diff 0.01, max rel diff 0.02 exceeds tolerance rtol=0.016 atol=0.01 (bf16)")
    assert len(group([a, b])) == 2
    assert reason_key("expected 2 GPUs, found 1", "x") != reason_key("expected 2 GPUs, found 0",
                                                                     "x")


def test_case_id():
    assert (case_id(f"{ZERO}[cpu-z3-off_opt-bf16-adam-gas4-ws2]")
            == "cpu-z3-off_opt-bf16-adam-gas4-ws2")
    assert case_id("suites/test_profile.py::test_gpu_count") == ""


def test_summarize_counts_known_issues_once_with_their_cases():
    outs = [Outcome(f"{ZERO}[c{i}]", "xfailed", "zero", "known", known_issue="DS-1")
            for i in range(3)] + [Outcome("t::ok", "passed", "zero")]
    s = summarize(outs, {"DS-1": {"title": "bug", "link": "https://x", "deepspeed": "<=1"}})
    assert s["capabilities"]["zero"] == {"xfailed": 3, "passed": 1}
    [k] = s["known_issues"]
    assert (k["id"], k["count"], k["link"]) == ("DS-1", 3, "https://x")
    text = "\n".join(lines(s, profile="p", host="h", notices=["only what is here"]))
    assert "NOTE: only what is here" in text and "3 x DS-1: bug https://x" in text
    assert "zero" in text and text.splitlines()[3].split()[-1] == "3"  # the known column


def test_a_short_case_id_stays_in_the_words_of_its_reason():
    nodeid = "suites/test_profile.py::test_half_precision_matmul[fp16]"
    reason = "profile h200-x2 promises [GPUs>=1 + fp16]: expected fp16 support, found CPU"
    [g] = group([(nodeid, reason)])
    assert g["reason"] == reason


def test_the_known_column_and_the_known_list_count_the_same_cases():
    """The known column counts strict xfails; the list under "known N" names each of them once:
    a registered issue by its id (not the covered case that failed another way: a failure), a
    limitation the suite marks itself by its reason."""
    outs = [Outcome(f"{ZERO}[c{i}]", "xfailed", "zero", "known upstream issue DS-1: bug",
                    known_issue="DS-1") for i in range(2)]
    outs += [Outcome(f"{ZERO}[c2]", "failed", "zero", "TypeError: a crash", known_issue="DS-1"),
             Outcome("suites/test_checkpoint.py::test_flip[cpu]", "xfailed", "checkpoint",
                     "known limitation: torch.load does not check the CRC"),
             Outcome("t::ok", "passed", "zero")]
    s = summarize(outs, {"DS-1": {"title": "bug", "link": "https://x", "deepspeed": "<=1"}})
    [k] = s["known_issues"]
    assert (k["count"], k["cases"]) == (2, [f"{ZERO}[c0]", f"{ZERO}[c1]"])
    out = lines(s, profile="p", host="h")
    column = sum(int(ln.split()[-1]) for ln in out[2:4])
    head = out.index("known 3 (strict xfails: known upstream issues and limitations, not node "
                     "failures):")
    listed = out[head + 1:]
    assert listed == ["     2 x DS-1: bug https://x (DeepSpeed <=1)",
                      "     1 x known limitation: torch.load does not check the CRC"]
    assert column == 3 == sum(int(ln.split()[0]) for ln in listed)
    assert "failed 1, by reason:" in out and "     1 x TypeError: a crash" in out
