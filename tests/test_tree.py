"""The DDTree builder and the greedy tree acceptance (kernels.md §4.4) against direct
implementations of the spec's rules: hand-worked trees (ties included), an exhaustive oracle (with
distinct scores the best-first tree is the ``verify_size - 1`` best nodes of the full candidate tree,
which is closed under parents because a child never scores above its parent), the survival floor,
and the greedy walk against a target whose argmax is known."""

import itertools
import math

import pytest
import torch

import dspark.kernels as K
from conftest import DEVICE


def _tree_of(tree, b=0):
    """Row b as {(path of tokens): score} for the nodes after the root."""
    n = int(tree.num_nodes[b])
    tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
    paths = {0: ()}
    for i in range(1, n):
        paths[i] = paths[parents[i]] + (tokens[i],)
    return {paths[i]: float(tree.scores[b, i]) for i in range(1, n)}


def test_a_hand_worked_tree_with_ties_and_confidence():
    # V = 4, P = 2, top-2. Depth 1: token 2, then 0 and 1 tied (the lower token, 0, is the second
    # candidate); depth 2: tokens 1 and 3. Scores (log-softmax + log confidence):
    #   (2,) > (2, 1) > (0,) > (2, 3) == (0, 1) exactly (both differ from the others by the same
    #   logit gaps) -> the tie goes to the lower parent index: (2, 3), under node 1.
    logits = torch.tensor([[[0.0] * 4, [1.0, 1.0, 3.0, -5.0], [0.0, 4.0, 0.0, 2.0]]])
    conf = torch.tensor([[0.5, 0.25]])
    tree = K.ddtree_build(logits, torch.tensor([7]), torch.tensor([10]), candidate_top_k=2, verify_size=5,
                          depth_confidence=conf)
    assert tree.tokens[0].tolist() == [7, 2, 1, 0, 3]
    assert tree.parents[0].tolist() == [-1, 0, 1, 0, 1] and tree.depths[0].tolist() == [0, 1, 2, 1, 2]
    lp1, lp2 = torch.log_softmax(logits[0, 1], -1), torch.log_softmax(logits[0, 2], -1)
    c1, c2 = math.log(0.5), math.log(0.25)
    expected = [0.0, lp1[2] + c1, lp1[2] + c1 + lp2[1] + c2, lp1[0] + c1, lp1[2] + c1 + lp2[3] + c2]
    assert tree.scores[0].tolist() == pytest.approx([float(x) for x in expected], abs=1e-5)
    assert float(lp1[0] + lp2[1]) == pytest.approx(float(lp1[2] + lp2[3]), abs=1e-6)  # the tie is real
    assert tree.positions[0].tolist() == [10, 11, 12, 11, 12]
    assert int(tree.context_lengths[0]) == 15 and int(tree.num_nodes[0]) == 5
    assert tree.ancestors[0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0],
                                                [1, 1, 0, 0, 1]]


def test_ties_order_by_parent_then_slot_then_token():
    # every logit equal: all candidates tie; parent index, then slot, then token decide
    logits = torch.zeros(1, 3, 5)
    tree = K.ddtree_build(logits, torch.tensor([4]), torch.tensor([0]), candidate_top_k=2, verify_size=7)
    # depth 1: tokens 0, 1 (slots 0, 1, root's children); then node 1's children before node 2's
    assert tree.tokens[0].tolist() == [4, 0, 1, 0, 1, 0, 1]
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("seed", range(6))
def test_best_first_equals_the_best_nodes_of_the_full_tree(seed):
    g = torch.Generator().manual_seed(seed)
    b, p, v, k, size = 3, 3, 11, 3, 9
    logits = torch.randn(b, p + 1, v, generator=g) * 2
    conf = torch.rand(b, p, generator=g) * 0.9 + 0.05
    tree = K.ddtree_build(logits, torch.tensor([1, 2, 3]), torch.tensor([5, 0, 9]), candidate_top_k=k,
                          verify_size=size, depth_confidence=conf)
    for row in range(b):
        lp = torch.log_softmax(logits[row, 1:].double(), -1)
        top = [lp[d].topk(k).indices.tolist() for d in range(p)]
        full = {}
        for depth in range(1, p + 1):
            for path in itertools.product(*top[:depth]):
                full[path] = sum(float(lp[d, t]) + math.log(float(conf[row, d])) for d, t in enumerate(path))
        best = sorted(full, key=lambda path: -full[path])[: size - 1]
        assert set(_tree_of(tree, row)) == set(best)
        assert all(path[:-1] in set(best) | {()} for path in best)  # closed under parents
        mask = tree.ancestors[row]
        parents = tree.parents[row].tolist()
        for i in range(size):  # ancestor-or-self
            chain, j = {i}, i
            while parents[j] >= 0:
                j = parents[j]
                chain.add(j)
            assert set(torch.nonzero(mask[i]).flatten().tolist()) == chain


def test_the_survival_floor_limits_the_depth():
    logits = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(0))
    conf = torch.tensor([[0.9, 0.8, 0.5, 0.9]])  # prefix survival 0.9, 0.72, 0.36, 0.324
    deep = K.ddtree_build(logits, torch.tensor([0]), torch.tensor([0]), candidate_top_k=1, verify_size=5,
                          depth_confidence=conf)
    assert deep.depths[0].tolist() == [0, 1, 2, 3, 4]
    floor = K.ddtree_build(logits, torch.tensor([0]), torch.tensor([0]), candidate_top_k=1, verify_size=5,
                           depth_confidence=conf, survival_threshold=0.7)
    assert int(floor.num_nodes[0]) == 3 and floor.depths[0, :3].tolist() == [0, 1, 2]  # depths 1, 2 survive
    assert floor.parents[0, 3:].tolist() == [-1, -1]  # unused slots
    lowest = K.ddtree_build(logits, torch.tensor([0]), torch.tensor([0]), candidate_top_k=2, verify_size=5,
                            depth_confidence=conf, survival_threshold=0.95)
    assert int(lowest.depths[0].max()) == 1  # at least one depth


def test_greedy_tree_accept_walks_the_targets_argmax():
    # tree: root(9) -> a=1 [1], b=2 [2]; a -> 3 [3]; a -> 4 [4]; 3 -> 5 [5]
    tree = K.ddtree_build(torch.zeros(1, 4, 6), torch.tensor([9]), torch.tensor([0]), candidate_top_k=1,
                          verify_size=1)
    tokens = torch.tensor([[9, 1, 2, 3, 4, 5]], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]], dtype=torch.int32)
    depths = torch.tensor([[0, 1, 1, 2, 2, 3]], dtype=torch.int32)
    tree = K.TreeBatch(tokens, parents, depths, torch.zeros(1, 6, 6, dtype=torch.bool), depths, torch.tensor([6]),
                       torch.tensor([6]), torch.zeros(1, 6))

    def target(next_of):
        logits = torch.zeros(1, 6, 8)
        for node, token in next_of.items():
            logits[0, node, token] = 5.0
        return logits

    accepted, nodes, n = K.greedy_tree_accept(target({0: 1, 1: 4, 4: 7}), tree)  # root -> a -> 4 -> bonus 7
    assert n.tolist() == [3] and accepted[0, :3].tolist() == [1, 4, 7] and nodes[0, :2].tolist() == [1, 4]
    accepted, nodes, n = K.greedy_tree_accept(target({0: 2, 2: 6}), tree)  # b, then no child: bonus 6
    assert n.tolist() == [2] and accepted[0, :2].tolist() == [2, 6] and nodes[0].tolist()[:1] == [2]
    accepted, nodes, n = K.greedy_tree_accept(target({0: 7}), tree)  # nothing accepted: the target's token
    assert n.tolist() == [1] and accepted[0, 0] == 7 and nodes[0].tolist() == [-1] * 6
    accepted, _, n = K.greedy_tree_accept(target({0: 1, 1: 3, 3: 5, 5: 0}), tree)  # the deepest path + bonus
    assert n.tolist() == [4] and accepted[0, :4].tolist() == [1, 3, 5, 0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(candidate_top_k=9), r"candidate_top_k must be in \[1, 8\]"),
    (dict(verify_size=0), r"verify_size must be in \[1, 64\]"),
    (dict(verify_size=65), r"verify_size must be in \[1, 64\], got 65"),  # the ancestor bitmasks' width
    (dict(survival_threshold=1.0), r"survival_threshold must be in \[0, 1\)"),
    (dict(depth_confidence=torch.ones(1, 3)), "depth_confidence"),
])
def test_bad_arguments_are_named(kwargs, message):
    args = dict(candidate_top_k=2, verify_size=4)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        K.ddtree_build(torch.zeros(1, 3, 10), torch.tensor([0]), torch.tensor([0]), **args)


def _heap_tree(logits, roots, k, size, conf=None, threshold=0.0, max_depths=None):
    """The spec's best-first rules written directly (a heap of (-score, parent, slot, token)):
    per row the (parent, depth, token) of each node after the root."""
    import heapq

    # f32 on the logits' device, as the builder computes it (the GPU's rounding makes other near-ties)
    lp = torch.log_softmax(logits[:, 1:], -1).cpu()
    order = torch.sort(lp, dim=-1, descending=True, stable=True)
    out = []
    for b in range(logits.shape[0]):
        bonus = [0.0] * lp.shape[1] if conf is None else [math.log(max(float(x), 1e-20)) for x in conf[b]]
        limit = lp.shape[1]
        if conf is not None and threshold > 0:
            survival, limit = 0.0, 0
            for x in bonus:
                survival += x
                limit += survival >= math.log(threshold)
            limit = max(1, limit)
        if max_depths is not None:
            limit = min(limit, max(1, int(max_depths[b])))
        nodes, frontier = [(-1, 0, int(roots[b]), 0.0)], []

        def offer(i):
            parent_depth, score = nodes[i][1], nodes[i][3]
            if parent_depth + 1 > limit:
                return
            for slot in range(k):
                token = int(order.indices[b, parent_depth, slot])
                gain = float(order.values[b, parent_depth, slot]) + bonus[parent_depth]
                heapq.heappush(frontier, (-(score + gain), i, slot, token, parent_depth + 1))

        offer(0)
        while frontier and len(nodes) < size:
            neg, i, _, token, depth = heapq.heappop(frontier)
            nodes.append((i, depth, token, -neg))
            offer(len(nodes) - 1)
        out.append([(p, d, t) for p, d, t, _ in nodes[1:]])
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("seed", range(8))
def test_the_batched_builder_equals_the_heap_rules_with_ties(seed, backend):
    """Integer logits (many exact ties), confidences, survival floors and per-row depth limits, on
    both backends' growth (Triton under ``TRITON_INTERPRET=1`` on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    b, p, v = 4, 5, 9
    k, size = [(2, 12), (3, 7), (8, 20), (1, 4)][seed % 4]
    logits = torch.randint(-2, 3, (b, p + 1, v), generator=g).float()
    conf = None if seed % 2 else torch.randint(1, 5, (b, p), generator=g).float() / 4
    threshold = 0.3 if seed % 4 == 2 else 0.0
    max_depths = torch.randint(1, p + 1, (b,), generator=g) if seed % 3 == 0 else None
    roots = torch.arange(b)
    dev = DEVICE if backend == "triton" else "cpu"  # Triton: the GPU, or its interpreter on the CPU
    with K.use_backend(backend):
        tree = K.ddtree_build(logits.to(dev), roots.to(dev), torch.zeros(b, dtype=torch.long, device=dev),
                              candidate_top_k=k, verify_size=size, depth_confidence=None if conf is None else conf.to(dev),
                              survival_threshold=threshold, max_depths=None if max_depths is None else max_depths.to(dev))
    expected = _heap_tree(logits.to(dev), roots, k, size, conf, threshold, max_depths)
    for row in range(b):
        n = int(tree.num_nodes[row])
        got = list(zip(tree.parents[row, 1:n].tolist(), tree.depths[row, 1:n].tolist(), tree.tokens[row, 1:n].tolist()))
        assert got == expected[row]
        assert tree.parents[row, n:].tolist() == [-1] * (size - n)


@pytest.mark.parametrize("size,k", [(64, 8), (33, 3), (1, 2)])
def test_both_backends_grow_the_same_trees(size, k):
    """Every output of the builder, bit for bit, Triton against the reference (float logits, the
    widest tree, a one-node one)."""
    g = torch.Generator().manual_seed(size)
    b, p, v = 3, 7, 50
    logits = torch.randn(b, p + 1, v, generator=g).to(DEVICE)
    conf = torch.rand(b, p, generator=g).to(DEVICE)

    def build():
        return K.ddtree_build(logits, torch.tensor([3, 4, 5], device=DEVICE), torch.tensor([0, 10, 20], device=DEVICE),
                              candidate_top_k=k, verify_size=size, depth_confidence=conf)

    with K.use_backend("reference"):
        expected = build()
    with K.use_backend("triton"):
        got = build()
    for name in ("tokens", "parents", "depths", "ancestors", "positions", "num_nodes", "context_lengths", "scores",
                 "ancestor_bits"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_sampled_tree_accept_emits_the_targets_distribution_at_every_node():
    """testing.md §5: the first token follows the target at the root; given it is a child's token,
    the walk is at that child and the next token follows the target there; any other first token
    ends the round. One tree, 8 x draws_for(V) independent walks of it."""
    from statistics_cases import assert_distribution, draws_for

    g = torch.Generator().manual_seed(0)
    v, p, k, size = 8, 4, 3, 10
    target_logits = torch.randn(size, v, generator=g) * 1.5
    draft = torch.cat([torch.zeros(1, 1, v), target_logits[None, 1:p + 1] + 0.3 * torch.randn(1, p, v, generator=g)], 1)
    draft[0, 1] = target_logits[0]  # depth 1 guesses the root's distribution, so its children carry mass
    tree = K.ddtree_build(draft, torch.tensor([5]), torch.tensor([0]), candidate_top_k=k, verify_size=size)
    n = 8 * draws_for(v)
    batch = K.TreeBatch(*(t.expand(n, *t.shape[1:]) for t in (tree.tokens, tree.parents, tree.depths)), None, None,
                        tree.num_nodes.expand(n), None, None)
    probs = torch.softmax(target_logits, -1)
    uniforms = torch.rand(n, p + 1, k + 1, generator=g)
    accepted, nodes, length = K.sampled_tree_accept(probs[None].expand(n, size, v), batch, uniforms, max_depth=p)
    assert_distribution(accepted[:, 0], probs[0], "first token (root)")
    parents, tokens = tree.parents[0].tolist(), tree.tokens[0].tolist()
    children = [i for i in range(1, int(tree.num_nodes[0])) if parents[i] == 0]
    checked = 0
    for child in children:
        rows = accepted[:, 0] == tokens[child]
        assert bool((nodes[rows, 0] == child).all()) and bool((length[rows] >= 2).all())
        if int(rows.sum()) >= draws_for(v):
            assert_distribution(accepted[rows, 1], probs[child], f"token after child {child}")
            checked += 1
    assert checked >= 1
    off_tree = ~torch.isin(accepted[:, 0], torch.tensor([tokens[c] for c in children]))
    assert bool((length[off_tree] == 1).all()) and bool((nodes[off_tree, 0] == -1).all())
