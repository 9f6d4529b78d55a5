"""routing_counts.py: moe_bench's deterministic expert sizes (cuda/bench/routing_counts.h), for the
Python scripts beside it: expert e gets a share of the rows proportional to w_e (uniform: 1, zipf:
1/(e+1)), floor'ed, and the rows left over go one each to experts 0, 1, ..."""


def routing_counts(rows, experts, routing):
    weights = [1.0 if routing == "uniform" else 1.0 / (e + 1) for e in range(experts)]
    total = sum(weights)
    counts = [int(rows * w / total) for w in weights]
    for e in range(rows - sum(counts)):
        counts[e % experts] += 1
    return counts
