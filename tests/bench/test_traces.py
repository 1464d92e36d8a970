"""Trace generator: statistics match parameters, reproducibility, JSONL round trip, prompt text.

Statistical checks use fixed seeds; each tolerance is derived from the sample size (about 3.9
standard errors, the two-sided normal quantile at alpha = 1e-4, or the chi-square quantile at
alpha = 1e-4 by the Wilson-Hilferty approximation), so a correct generator fails one with
probability about 1e-4, and a wrong one by a wide margin.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest
from pydoc_data.topics import topics as MANUAL

from bench.passages import (
    FAMILIES,
    TASKS,
    PassageStream,
    UnknownTaskError,
    approx_tokens,
    load_passages,
    render,
)
from bench.traces import (
    FORMAT_VERSION,
    PATTERNS,
    PROFILES,
    MarkovPattern,
    TraceConfig,
    TraceConfigError,
    TraceFormatError,
    UnknownPatternError,
    dump_lines,
    gaussian_weights,
    generate_trace,
    load_trace,
    main,
    markov_rank_probabilities,
    parse_lines,
    save_trace,
)

ALPHA = 1e-4  # false-alarm probability of each statistical check
Z = NormalDist().inv_cdf(1 - ALPHA / 2)  # two-sided normal quantile, about 3.9 standard errors
N_CALLS = 4000  # calls per statistical trace


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """Upper alpha quantile of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def counts(trace, n: int) -> np.ndarray:
    return np.bincount([r.context_id for r in trace.records], minlength=n).astype(float)


def repeat_rate(trace) -> tuple[float, int]:
    ids = [r.context_id for r in trace.records]
    pairs = len(ids) - 1
    return sum(a == b for a, b in zip(ids, ids[1:])) / pairs, pairs


def binomial_tolerance(p: float, n: int) -> float:
    return Z * math.sqrt(p * (1 - p) / n)


@pytest.fixture(scope="module")
def traces():
    """One long trace per pattern, 8 contexts (generated once: about 0.1 s each)."""
    return {
        name: generate_trace(TraceConfig(pattern=name, contexts=8, calls=N_CALLS), 7)
        for name in PATTERNS
    }


# -- arrivals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.2, 5.0])
def test_mean_gap_matches_rate(rate):
    trace = generate_trace(TraceConfig(calls=N_CALLS, rate_per_s=rate), 11)
    times = np.array([r.time_s for r in trace.records])
    gaps = np.diff(times, prepend=0.0)
    assert (gaps >= 0).all()
    mean = 1 / rate  # an exponential's standard deviation equals its mean
    assert abs(gaps.mean() - mean) <= Z * mean / math.sqrt(N_CALLS)
    assert trace.mean_gap_s() == pytest.approx(gaps.mean())
    # Shape, not just mean: P(gap > mean) = 1/e for an exponential.
    assert abs((gaps > mean).mean() - math.exp(-1)) <= binomial_tolerance(math.exp(-1), N_CALLS)


# -- switching patterns ----------------------------------------------------------------------------


def test_random_is_uniform(traces):
    n = 8
    observed = counts(traces["random"], n)
    assert chi2(observed, np.full(n, N_CALLS / n)) < chi2_critical(n - 1)


def test_markov_repeats_match_p0_and_exceed_random(traces):
    n, decay = 8, 0.5
    p0 = (1 - decay) / (1 - decay**n)  # documented repeat probability
    markov, pairs = repeat_rate(traces["markov"])
    random, _ = repeat_rate(traces["random"])
    assert abs(markov - p0) <= binomial_tolerance(p0, pairs)
    assert abs(random - 1 / n) <= binomial_tolerance(1 / n, pairs)
    assert markov - random > binomial_tolerance(p0, pairs) + binomial_tolerance(1 / n, pairs)


def recency_ranks(ids: list[int], n: int) -> list[int]:
    """Rank (0 = last called) of each call's context, once every context has been called."""
    order: list[int] = []
    ranks = []
    for c in ids:
        if len(order) == n:
            ranks.append(order.index(c))
        if c in order:
            order.remove(c)
        order.insert(0, c)
    return ranks


@pytest.mark.parametrize("decay", [0.5, 0.8])
def test_markov_rank_frequencies_match_transition_row(decay):
    n = 6
    config = TraceConfig(pattern="markov", contexts=n, calls=N_CALLS, markov_decay=decay)
    ranks = recency_ranks([r.context_id for r in generate_trace(config, 3).records], n)
    observed = np.bincount(ranks, minlength=n).astype(float)
    expected = np.array([decay**r for r in range(n)]) / sum(decay**r for r in range(n)) * len(ranks)
    assert expected.min() >= 5  # the chi-square approximation holds
    assert chi2(observed, expected) < chi2_critical(n - 1)


def test_markov_rank_probabilities_are_the_documented_geometric_row():
    p = markov_rank_probabilities(5, 0.5)
    assert p.sum() == pytest.approx(1)
    assert p[1:] / p[:-1] == pytest.approx(np.full(4, 0.5))
    assert markov_rank_probabilities(4, 1.0) == pytest.approx(np.full(4, 0.25))


def test_markov_state_moves_the_called_context_to_rank_zero():
    config = TraceConfig(pattern="markov", contexts=4, markov_decay=0.5)
    rng = np.random.default_rng(0)
    pattern = MarkovPattern(range(4), config, rng)
    for _ in range(20):
        c = pattern.choose(rng)
        p = pattern.probabilities()
        assert p[c] == pytest.approx(markov_rank_probabilities(4, 0.5)[0])
        assert p.sum() == pytest.approx(1)


def documented_gaussian(ranges, width):
    """The module docstring's formula, written out independently."""
    x = [math.log(math.sqrt(lo * hi)) for lo, hi in ranges]
    m, s = (max(x) + min(x)) / 2, width * (max(x) - min(x)) / 2
    w = [math.exp(-((xi - m) ** 2) / (2 * s * s)) for xi in x]
    return np.array(w) / sum(w)


def test_gaussian_favours_moderate_deltas():
    n = 12  # every profile twice
    trace = generate_trace(TraceConfig(pattern="gaussian", contexts=n, calls=N_CALLS), 5)
    ranges = [(c.delta_min_tokens, c.delta_max_tokens) for c in trace.contexts]
    p = documented_gaussian(ranges, 0.5)
    assert gaussian_weights(ranges, 0.5) == pytest.approx(p)
    observed = counts(trace, n)
    assert chi2(observed, p * N_CALLS) < chi2_critical(n - 1)

    x = np.array([math.log(lo * hi) / 2 for lo, hi in ranges])
    centre = (x.max() + x.min()) / 2
    middle = np.abs(x - centre) == np.abs(x - centre).min()
    extreme = (x == x.max()) | (x == x.min())
    f_mid, f_ext = observed[middle].mean() / N_CALLS, observed[extreme].mean() / N_CALLS
    tol = binomial_tolerance(f_mid, N_CALLS) + binomial_tolerance(f_ext, N_CALLS)
    assert f_mid - f_ext > tol
    # Extremes are exp(-1 / (2 w^2)) times as likely as a context exactly at the centre.
    at_centre = documented_gaussian([(100, 100), (10, 10), (1000, 1000)], 0.5)
    assert at_centre[1] / at_centre[0] == pytest.approx(math.exp(-2))


def test_gaussian_with_equal_workloads_is_uniform():
    assert gaussian_weights([(50, 100)] * 4, 0.5) == pytest.approx(np.full(4, 0.25))


# -- delta lengths ---------------------------------------------------------------------------------


def test_deltas_stay_in_their_contexts_scaled_table3_ranges(traces):
    trace = traces["random"]
    for r in trace.records:
        spec = trace.contexts[r.context_id]
        assert spec.delta_min_tokens <= r.delta_tokens_target <= spec.delta_max_tokens
    config = trace.config
    for name, p in PROFILES.items():
        lo, hi = config.delta_range(name)
        assert lo == max(32, round(p.delta_min_tokens * 0.5))
        assert hi == round(p.delta_max_tokens * 0.5)
    assert {c.profile for c in generate_trace(TraceConfig(contexts=6, calls=1), 0).contexts} == set(
        PROFILES
    )


# -- reproducibility -------------------------------------------------------------------------------


def test_same_seed_same_trace_other_seed_other_trace():
    config = TraceConfig(pattern="markov", contexts=5, calls=200)
    a, b = generate_trace(config, 42), generate_trace(config, 42)
    assert a == b
    c = generate_trace(config, 43)
    assert [r.time_s for r in a.records] != [r.time_s for r in c.records]
    assert [r.context_id for r in a.records] != [r.context_id for r in c.records]


def test_patterns_share_calling_times_for_one_seed(traces):
    times = {name: [r.time_s for r in t.records] for name, t in traces.items()}
    assert times["random"] == times["markov"] == times["gaussian"]


# -- JSON lines ------------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path: Path):
    trace = generate_trace(TraceConfig(pattern="gaussian", contexts=3, calls=20, rate_per_s=2.0), 1)
    path = tmp_path / "t.jsonl"
    save_trace(trace, path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 21 and json.loads(lines[0])["version"] == FORMAT_VERSION
    assert load_trace(path) == trace


@pytest.fixture()
def lines():
    return list(dump_lines(generate_trace(TraceConfig(contexts=3, calls=4), 0)))


def edit(line: str, **changes) -> str:
    obj = json.loads(line)
    for k, v in changes.items():
        if v is ...:
            del obj[k]
        else:
            obj[k] = v
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("line", "changes", "message"),
    [
        (0, {"version": FORMAT_VERSION + 1}, "unsupported trace version"),
        (0, {"format": "csv"}, "not a trace header"),
        (0, {"seed": ...}, "lacks field.*seed"),
        (0, {"config": {"contexts": 3}}, "config lacks field"),
        (1, {"prompt": ...}, "lacks field.*prompt"),
        (1, {"extra": 1}, "unknown field.*extra"),
        (1, {"time_s": "1.5"}, "time_s"),
        (1, {"time_s": -1.0}, "time_s"),
        (1, {"context_id": "0"}, "context_id"),
        (1, {"context_id": 3}, r"0\.\.2"),
        (1, {"context_id": True}, "context_id"),
        (1, {"delta_tokens_target": 12.5}, "delta_tokens_target"),
        (1, {"delta_tokens_target": 0}, "delta_tokens_target"),
        (1, {"prompt": ""}, "prompt"),
        (2, {"time_s": 0.0}, "before the previous call"),
    ],
)
def test_malformed_fields_are_rejected(lines, line, changes, message):
    lines[line] = edit(lines[line], **changes)
    with pytest.raises(TraceFormatError, match=message) as e:
        parse_lines(lines, source="t.jsonl")
    assert f"t.jsonl:{line + 1}" in str(e.value)


def test_bad_header_config_is_rejected(lines):
    head = json.loads(lines[0])
    head["config"]["pattern"] = "zipf"
    lines[0] = json.dumps(head)
    with pytest.raises(TraceFormatError, match="bad config.*gaussian, markov, random"):
        parse_lines(lines)


def test_non_json_line_truncation_and_empty_files_are_rejected(lines, tmp_path: Path):
    with pytest.raises(TraceFormatError, match=r"t.jsonl:3: not JSON"):
        parse_lines([*lines[:2], "{time_s: 1", *lines[3:]], source="t.jsonl")
    with pytest.raises(TraceFormatError, match="promises 4 calls, found 3"):
        parse_lines(lines[:-1])
    with pytest.raises(TraceFormatError, match="must be a JSON object"):
        parse_lines([*lines, "[1, 2]"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceFormatError, match="empty trace"):
        load_trace(empty)
    assert issubclass(TraceFormatError, ValueError)


# -- prompts ---------------------------------------------------------------------------------------


def passage_pieces(prompt: str) -> list[str]:
    """The passage text of a prompt, split at paragraph breaks."""
    for marker in ("\n\nPassage: ", "\n\nNotes: ", "\n\nText: "):
        if marker in prompt:
            return prompt.split(marker, 1)[1].split("\n\n")
    raise AssertionError(f"no passage in {prompt[:80]!r}")


def test_prompts_quote_their_contexts_family_of_the_reference_manual(traces):
    trace = traces["markov"]
    family_text = {
        f: "\n".join(" ".join(MANUAL[t].split()) for t in keys if t in MANUAL)
        for f, keys in FAMILIES.items()
    }
    for r in trace.records[:600]:
        spec = trace.contexts[r.context_id]
        template = TASKS[PROFILES[spec.profile].task]
        assert r.prompt.startswith(template[: template.index("{")])
        for piece in passage_pieces(r.prompt):
            assert len(piece.split()) >= 1
            assert piece in family_text[spec.family], piece[:80]


@pytest.mark.parametrize(
    "count_tokens", [approx_tokens, lambda s: len(s.split())], ids=["chars/4", "words"]
)
def test_prompt_lengths_track_delta_targets(count_tokens):
    trace = generate_trace(TraceConfig(contexts=12, calls=600), 9, count_tokens=count_tokens)
    # A prompt is cut at a word boundary below its target: it can fall short by one word plus the
    # separator before it, and rounding in the counter.
    longest_word = max(
        count_tokens(w) for ps in load_passages().values() for p in ps for w in p.text.split()
    )
    for r in trace.records:
        share = PROFILES[trace.contexts[r.context_id].profile].reply_share
        target = round(r.delta_tokens_target * (1 - share))
        assert target - (longest_word + 2) <= count_tokens(r.prompt) <= target
    assert trace.token_counter == count_tokens.__qualname__


def test_passages_are_clean_paragraphs():
    passages = load_passages()
    assert set(passages) == set(FAMILIES)
    for family, ps in passages.items():
        assert len(ps) >= 50, family
        for p in ps:
            assert "\n" not in p.text and "  " not in p.text and "::=" not in p.text
            assert not set(p.text) <= set("*=-~^ ")
            assert p.text in " ".join(MANUAL[p.topic].split())


def test_passage_stream_continues_and_wraps():
    ps = load_passages()["syntax"]
    stream = PassageStream(ps, len(ps) - 1, approx_tokens)
    text, first = stream.take(10_000)
    assert first == ps[-1]
    assert text.startswith(ps[-1].text + "\n\n" + ps[0].text)
    with pytest.raises(ValueError, match="at least one passage"):
        PassageStream([], 0, approx_tokens)
    with pytest.raises(UnknownTaskError, match="answer, classify"):
        render("poem", "x")


# -- configuration and CLI -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"contexts": 0}, r"contexts must be 2\.\.64, got 0"),
        ({"contexts": 65}, r"contexts must be 2\.\.64"),
        ({"contexts": 8.0}, "contexts must be an integer"),
        ({"calls": 0}, "calls must be >= 1"),
        ({"rate_per_s": -0.5}, "rate_per_s must be > 0"),
        ({"rate_per_s": float("nan")}, "rate_per_s must be a finite number"),
        ({"markov_decay": 1.5}, r"markov_decay must be in \(0, 1\]"),
        ({"pattern": "zipf"}, "unknown switching pattern 'zipf'; valid: gaussian, markov, random"),
        ({"profiles": ("imdb",)}, "unknown delta-length profile 'imdb'; valid: agnews, xsum"),
    ],
)
def test_bad_config_values_raise_clear_errors(changes, message):
    with pytest.raises(TraceConfigError, match=message):
        TraceConfig(**changes)


def test_unknown_pattern_is_a_value_error_listing_valid_names():
    with pytest.raises(ValueError) as e:
        TraceConfig(pattern="Markov")
    assert isinstance(e.value, UnknownPatternError)
    assert all(name in str(e.value) for name in PATTERNS)
    with pytest.raises(TraceConfigError, match="seed"):
        generate_trace(TraceConfig(), -1)


def test_cli_writes_the_trace_and_a_summary(tmp_path: Path, capsys):
    out = tmp_path / "trace.jsonl"
    argv = ["--pattern", "markov", "--contexts", "8", "--calls", "30", "--rate", "0.5"]
    assert main([*argv, "--seed", "0", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("calls=30 contexts=8 pattern=markov mean_gap_s=")
    assert "mean_delta_tokens=" in err and err.count("\n") == 1
    config = TraceConfig(pattern="markov", contexts=8, calls=30, rate_per_s=0.5)
    assert load_trace(out) == generate_trace(config, 0)


def test_cli_rejects_bad_values_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--pattern", "zipf"])
    assert e.value.code == 2 and "gaussian" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--contexts", "0"])
    assert e.value.code == 2 and "2..64" in capsys.readouterr().err


def test_cli_help_runs_as_a_module():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "bench.traces", "--help"], cwd=root, capture_output=True, text=True,
        timeout=30, check=True,
    )
    assert "--pattern {gaussian,markov,random}" in done.stdout and "calls per second" in done.stdout
