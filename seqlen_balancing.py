"""Micro-batches by tokens: a mini-batch's samples split over the data-parallel ranks so
that each holds about as many tokens (Karmarkar-Karp, as verl's seqlen_balancing), then
packed into micro-batches of at most a token budget, every rank running as many.

    ranks = token_budget_micro_batches(samples, budget=4096, shared_prefix=True, dp_size=8)
    my_micro_batches = ranks[dp_rank]      # lists of samples; fillers carry "in_loss": False

Pure logic on the samples' lengths: imports the standard library only.
"""

import heapq
import itertools


def karmarkar_karp(costs, parts):
    """Indices into `costs` split into `parts` lists of near-equal cost sums: the largest
    differencing method (Karmarkar-Karp), as verl's seqlen_balancing. Each partial solution
    is `parts` (sum, indices) subsets, largest first; the two of largest spread merge, the
    largest subset of one with the smallest of the other. Each list in ascending order; one
    may be empty where there are fewer costs than parts."""
    tie = itertools.count()
    heap = [(-cost, next(tie), [(cost, [index])] + [(0, [])] * (parts - 1)) for index, cost in enumerate(costs)]
    heapq.heapify(heap)
    while len(heap) > 1:
        first, second = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        merged = sorted(((a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))), key=lambda x: -x[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], next(tie), merged))
    subsets = heap[0][2] if heap else [(0, [])] * parts
    return [sorted(indices) for _, indices in subsets]


def fill_micro_batches(costs, budget, count=1):
    """Indices into `costs` in at least `count` bins of at most `budget` cost each: first fit,
    costliest first (a cost over the budget alone in its bin); then, while fewer than
    `count`, the costliest bin of several items splits in two (Karmarkar-Karp). Fewer than
    `count` bins only where there are fewer items."""
    bins, loads = [], []
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        fits = next((b for b, load in enumerate(loads) if load + costs[index] <= budget), None)
        if fits is None:
            bins.append([])
            loads.append(0)
            fits = len(bins) - 1
        bins[fits].append(index)
        loads[fits] += costs[index]
    while len(bins) < count and any(len(b) > 1 for b in bins):
        costliest = max((b for b in bins if len(b) > 1), key=lambda b: sum(costs[i] for i in b))
        bins.remove(costliest)
        bins += [[costliest[i] for i in half] for half in karmarkar_karp([costs[i] for i in costliest], 2)]
    return [sorted(b) for b in bins]


def token_budget_micro_batches(samples, budget, shared_prefix, dp_size):
    """A mini-batch (`samples`: every data-parallel rank's) -> [per data-parallel rank: its
    micro-batches, lists of samples], by tokens: the units (a sample, or with
    `shared_prefix` a whole group) go to ranks by Karmarkar-Karp on their tokens (prompt
    once per group under shared_prefix, every response), then fill micro-batches of at most
    `budget` tokens (a longer unit alone). Every rank gets as many micro-batches (megatron's
    DDP and the collectives of each forward need it): a rank with fewer units than that
    runs the smallest unit again, out of the loss ("in_loss" False: zero weight)."""
    key = (lambda i: samples[i]["group"]) if shared_prefix else (lambda i: i)
    units = [list(run) for _, run in itertools.groupby(range(len(samples)), key=key)]
    costs = [len(samples[unit[0]]["prompt_ids"]) * (1 if shared_prefix else len(unit))
             + sum(len(samples[i]["response_ids"]) for i in unit) for unit in units]
    ranks = karmarkar_karp(costs, dp_size)
    rank_costs = [[costs[unit] for unit in rank] for rank in ranks]
    count = max(len(fill_micro_batches(unit_costs, budget)) for unit_costs in rank_costs)
    bins = [[[rank[b] for b in bin_] for bin_ in fill_micro_batches(unit_costs, budget, count)]
            for rank, unit_costs in zip(ranks, rank_costs)]
    smallest = min(range(len(units)), key=lambda u: costs[u])
    filler = [dict(samples[i], in_loss=False) for i in units[smallest]]
    return [[[samples[i] for unit in bin_ for i in units[unit]] for bin_ in rank_bins]
            + [filler] * (count - len(rank_bins)) for rank_bins in bins]
