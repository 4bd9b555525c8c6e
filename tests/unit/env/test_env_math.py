"""Math environments: chain arithmetic's long tail and exact reward, the GSM8K-format loader, answer
extraction, and the optional math-verify scorer."""

from __future__ import annotations

import json
import statistics

import pytest

from dora.env import load_env
from dora.episode import run_episode
from dora.errors import ConfigError, DataError
from dora.protocol import SamplingParams
from envs.math import (
    ChainArithmeticEnv,
    GSM8KEnv,
    MathEnv,
    chain_arithmetic_tasks,
    exact_match,
    extract_answer,
    extract_boxed_answer,
    extract_hash_answer,
    load_gsm8k,
    math_verify_available,
    normalize_answer,
)

pytestmark = pytest.mark.timeout(30)


def test_chain_arithmetic_solution_lengths_are_long_tailed() -> None:
    tasks = chain_arithmetic_tasks(3000, seed=0)
    lengths = sorted(len(str(t["answer"])) for t in tasks)
    median, mean = statistics.median(lengths), statistics.mean(lengths)
    p99, longest = lengths[int(0.99 * len(lengths))], lengths[-1]
    assert mean > 1.5 * median, "right-skewed: the mean is pulled up by the tail"
    assert p99 > 8 * median and longest > 50 * median, "a heavy tail, not a bounded spread"
    assert min(t["num_terms"] for t in tasks) == 2  # type: ignore[type-var]
    assert max(t["num_terms"] for t in tasks) <= 200  # type: ignore[type-var]


def test_chain_arithmetic_is_seeded_and_its_solutions_are_right() -> None:
    a, b = chain_arithmetic_tasks(50, seed=3), chain_arithmetic_tasks(50, seed=3)
    assert a == b and a != chain_arithmetic_tasks(50, seed=4)
    assert len({t.prompt_id for t in a}) == 50
    for task in a:
        expression = str(task["question"]).removeprefix("Compute ")
        assert str(eval(expression)) == task["gold"]
        lines = str(task["answer"]).splitlines()
        assert len(lines) == task["num_terms"]  # one partial sum per operator, then ####
        assert lines[-1] == f"#### {task['gold']}"
    with pytest.raises(ValueError, match="min_terms"):
        chain_arithmetic_tasks(1, min_terms=1)


def test_chain_arithmetic_reward_is_exact() -> None:
    env = ChainArithmeticEnv()
    task = chain_arithmetic_tasks(1, seed=0)[0]
    gold = str(task["gold"])
    assert exact_match(str(task["answer"]), gold) == 1.0
    assert exact_match(f"...\n#### {int(gold) + 1}", gold) == 0.0
    assert exact_match(f"The answer is {gold}.", gold) == 0.0, "no marker, no credit"
    assert exact_match(f"so \\boxed{{{gold}}}", gold) == 1.0
    assert "partial sum" in env.prompt(task) and str(task["question"]) in env.prompt(task)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a\n#### 42", "42"),
        ("#### 1\nthen #### 1,234.", "1,234."),
        ("#### ", None),
        ("no answer", None),
        ("x = \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\boxed{3} then \\boxed{4}", "4"),
        ("\\boxed{unclosed", None),
        ("\\fbox{7}", "7"),
    ],
)
def test_answer_extraction(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_hash_wins_over_boxed_and_normalisation() -> None:
    assert extract_hash_answer("\\boxed{1}\n#### 2") == "2"
    assert extract_boxed_answer("#### 2") is None
    assert normalize_answer("$1,000.00") == "1000"
    assert normalize_answer("-3.50") == "-7/2" == normalize_answer("-7/2")
    assert normalize_answer("\\text{yes}") == "yes"
    assert exact_match("#### 20.0", "20") == 1.0


def write_jsonl(path, rows) -> None:  # type: ignore[no-untyped-def]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 2. How many?", "answer": "3+2=<<3+2=5>>5\n#### 5"},
    {"question": "A book costs $1,200. Half?", "answer": "1200/2=600\n#### 600"},
    {"question": "Count to three.", "answer": "1, 2, 3\n#### 3"},
]


def test_gsm8k_loader_reads_jsonl_and_parquet(tmp_path) -> None:
    import datasets

    jsonl = tmp_path / "gsm8k_small.jsonl"
    write_jsonl(jsonl, GSM8K_ROWS)
    cache = str(tmp_path / "cache")
    tasks = load_gsm8k(str(jsonl), cache_dir=cache)
    assert [t.prompt_id for t in tasks] == ["gsm8k_small:0", "gsm8k_small:1", "gsm8k_small:2"]
    assert [t["gold"] for t in tasks] == ["5", "600", "3"]
    assert tasks[0]["question"] == GSM8K_ROWS[0]["question"]

    parquet = tmp_path / "test.parquet"
    datasets.Dataset.from_list(GSM8K_ROWS).to_parquet(str(parquet))
    again = load_gsm8k(str(parquet), cache_dir=cache, limit=2, name="gsm")
    assert [(t.prompt_id, t["gold"]) for t in again] == [("gsm:0", "5"), ("gsm:1", "600")]


def test_gsm8k_loader_names_the_file_and_row_of_a_bad_row(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [GSM8K_ROWS[0], {"question": "q", "answer": "no marker"}])
    with pytest.raises(DataError, match=r"bad\.jsonl, row 1: answer has no '#### <answer>'"):
        load_gsm8k(str(bad), cache_dir=str(tmp_path / "cache"))
    other = tmp_path / "data.csv"
    other.write_text("question,answer\n")
    with pytest.raises(DataError, match=r"expected \.jsonl, \.json or \.parquet"):
        load_gsm8k(str(other))


async def test_gsm8k_env_scores_an_episode(tmp_path, tokenizer, scripted) -> None:
    jsonl = tmp_path / "g.jsonl"
    write_jsonl(jsonl, GSM8K_ROWS)
    task = load_gsm8k(str(jsonl), cache_dir=str(tmp_path / "cache"))[1]
    factory = load_env("envs.math:GSM8KEnv")
    for reply, reward in [("1200/2 = 600\n#### 600<|im_end|>", 1.0), ("#### 601<|im_end|>", 0.0)]:
        sample = await run_episode(
            sampler=scripted([reply]),
            tokenizer=tokenizer,
            env=factory(),
            task=task,
            params=SamplingParams(max_tokens=64),
        )
        assert not sample.masked and sample.reward == reward


def test_math_verify_is_optional() -> None:
    assert isinstance(GSM8KEnv(), MathEnv)
    with pytest.raises(ConfigError, match="scorer must be"):
        MathEnv(scorer="sympy")  # type: ignore[arg-type]
    if math_verify_available():
        pytest.skip("math-verify is installed; the missing-package error cannot be shown")
    with pytest.raises(ConfigError, match="pip install 'math-verify'"):
        MathEnv(scorer="math_verify")


def test_math_verify_episodes_of_a_process_share_one_pool() -> None:
    """`MathEnv.setup` makes the pool once per factory; an object built directly makes its own,
    which its `close()` ends."""
    from dora.env import ScorerPool

    assert MathEnv.setup(scorer="exact") == {}  # exact scoring needs no pool
    assert load_env("envs.math:GSM8KEnv")().pool is None
    shared = MathEnv.setup(scorer="math_verify")
    assert isinstance(shared["pool"], ScorerPool)  # lazy: no process until the first score
    assert MathEnv.setup(scorer="math_verify", pool=shared["pool"]) == {}  # the caller's own
    if not math_verify_available():
        pytest.skip("the episodes' sharing needs math-verify (MathEnv refuses the scorer without)")
    factory = load_env("envs.math:GSM8KEnv", scorer="math_verify")
    a, b = factory(), factory()
    assert isinstance(a, MathEnv) and isinstance(b, MathEnv)
    assert a.pool is not None and a.pool is b.pool


async def test_math_verify_scorer_in_a_process_pool() -> None:
    pytest.importorskip("math_verify")
    from dora.env import ScorerPool, Task

    task = Task("q", {"question": "half?", "gold": "\\frac{1}{2}"})
    async with ScorerPool(timeout_s=20) as pool:
        env = MathEnv(scorer="math_verify", pool=pool)
        assert await env.score("so \\boxed{0.5}", task) == 1.0
        assert await env.score("so \\boxed{0.6}", task) == 0.0
