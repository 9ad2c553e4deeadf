"""Tree verification: hand-built logits, chain equivalence, and a statistical test that sampling is lossless."""
from __future__ import annotations

import functools
import random
from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from eyas.decoding import verify
from eyas.decoding.builders import KARY, build_static
from eyas.decoding.logits import adjusted_logits
from eyas.decoding.sampling import SamplingParams
from eyas.decoding.tree import DraftTree, chain, from_paths
from eyas.decoding.verify import Accepted, process_logits, sample, verify_greedy, verify_sampling
from eyas.drafters.hybrid import merge
from eyas.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixIndex


def logits_choosing(tree: DraftTree, choice: dict[int, int], vocab: int = 10, default: int = 9) -> torch.Tensor:
    """[N, V] logits whose argmax at node i is choice.get(i, default)."""
    logits_NV = torch.zeros(tree.num_nodes, vocab)
    for i in range(tree.num_nodes):
        logits_NV[i, choice.get(i, default)] = 5.0
    return logits_NV


def one_hot_probs(tree: DraftTree, choice: dict[int, int], vocab: int = 10, default: int = 9) -> torch.Tensor:
    return logits_choosing(tree, choice, vocab, default).div(5.0)


# Tree used by the hand-built cases: root 0 -> {1, 2}; 1 -> {3}; 2 -> {4, 5}; 2-5 -> {6}
#   node ids:  0:root  1:'1'  2:'2'  3:'1-3'  4:'2-4'  5:'2-5'  6:'2-5-6'
BRANCHY = from_paths(0, [[1, 3], [2, 4], [2, 5, 6]])


def test_branchy_layout():
    assert BRANCHY.tokens_list == [0, 1, 2, 3, 4, 5, 6] and BRANCHY.parents_list == [-1, 0, 0, 1, 2, 2, 5]


# ---- greedy, hand-built -----------------------------------------------------------------------------------------

def test_greedy_full_accept():
    tree = chain(0, [1, 2, 3])
    assert verify_greedy(tree, logits_choosing(tree, {0: 1, 1: 2, 2: 3, 3: 4})) == Accepted([0, 1, 2, 3], [1, 2, 3], 4)


def test_greedy_first_token_mismatch():
    tree = chain(0, [1, 2, 3])
    assert verify_greedy(tree, logits_choosing(tree, {0: 7, 1: 2, 2: 3})) == Accepted([0], [], 7)


def test_greedy_empty_draft():
    accepted = verify_greedy(chain(4, []), torch.tensor([[0.0, 1.0, 3.0]]))
    assert accepted == Accepted([0], [], 2) and accepted.num_accepted == 0 and accepted.committed == [2]


def test_greedy_all_siblings_rejected():
    assert verify_greedy(BRANCHY, logits_choosing(BRANCHY, {0: 8})) == Accepted([0], [], 8)


def test_greedy_second_sibling_then_deeper():
    accepted = verify_greedy(BRANCHY, logits_choosing(BRANCHY, {0: 2, 2: 5, 5: 6, 6: 7}))
    assert accepted == Accepted([0, 2, 5, 6], [2, 5, 6], 7) and accepted.committed == [2, 5, 6, 7]
    assert verify_greedy(BRANCHY, logits_choosing(BRANCHY, {0: 2, 2: 4})) == Accepted([0, 2, 4], [2, 4], 9)


def test_greedy_rejects_wrong_shape():
    with pytest.raises(ValueError, match="one row per tree node"):
        verify_greedy(BRANCHY, torch.zeros(3, 10))


# ---- sampling, hand-built (one-hot targets force every decision) --------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_sampling_forced_second_sibling_then_residual_bonus(seed):
    g = torch.Generator().manual_seed(seed)
    # root: p = one_hot(2): child '1' is rejected (p = 0), '2' accepted (p = 1); at '2': p = one_hot(8), both
    # children rejected, the residual is one_hot(8)
    accepted = verify_sampling(BRANCHY, one_hot_probs(BRANCHY, {0: 2, 2: 8}), g)
    assert accepted == Accepted([0, 2], [2], 8)
    # a leaf accepted: the bonus comes from the target at the leaf
    assert verify_sampling(BRANCHY, one_hot_probs(BRANCHY, {0: 2, 2: 5, 5: 6, 6: 1}), g) == Accepted(
        [0, 2, 5, 6], [2, 5, 6], 1)
    assert verify_sampling(chain(3, []), torch.tensor([[0.0, 0.0, 1.0]]), g) == Accepted([0], [], 2)


@pytest.mark.parametrize("seed", range(3))
def test_sampling_forced_with_sampled_children(seed):
    g = torch.Generator().manual_seed(seed)
    draft_probs_NV = torch.full((4, 10), 0.1)
    tree = DraftTree(torch.tensor([0, 1, 1, 2]), torch.tensor([-1, 0, 0, 0]), torch.ones(4), draft_probs_NV,
                     sampled=True)  # three i.i.d. children, two of them repeat token 1
    assert verify_sampling(tree, one_hot_probs(tree, {0: 2, 3: 5}), g) == Accepted([0, 3], [2], 5)
    assert verify_sampling(tree, one_hot_probs(tree, {0: 7}), g) == Accepted([0], [], 7)  # residual of one_hot(7)
    with pytest.raises(ValueError, match="draft_probs_NV"):
        verify_sampling(DraftTree(tree.tokens_N, tree.parents_N, tree.scores_N, sampled=True),
                        one_hot_probs(tree, {}), g)


def test_sampling_residual_edge_cases():
    p_V = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert torch.equal(verify._residual(p_V, p_V.clone()), p_V)  # p == q: empty residual falls back to p
    certain_V = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert torch.equal(verify._without(certain_V, 1), certain_V)  # p(x) = 1 rejected: only by rounding
    assert verify._accept_probability(0.3, 0.0) == 1.0 and verify._accept_probability(0.0, 0.0) == 0.0
    assert verify._accept_probability(0.2, 0.4) == 0.5 and verify._accept_probability(0.5, 0.4) == 1.0


# ---- a chain-shaped tree verifies exactly like a textbook chain verifier ------------------------------------------

def reference_chain_greedy(tokens: list[int], target_logits_KV: torch.Tensor) -> tuple[list[int], int]:
    for k, token in enumerate(tokens):
        best = int(target_logits_KV[k].argmax())
        if token != best:
            return tokens[:k], best
    return tokens, int(target_logits_KV[len(tokens)].argmax())


def reference_chain_sampling(tokens, target_probs_KV, draft_probs_KV, sampled, g) -> tuple[list[int], int]:
    """Leviathan et al. / Chen et al. speculative sampling, drawing from g in the same order as verify_sampling."""
    for k, x in enumerate(tokens):
        p = target_probs_KV[k].double() / target_probs_KV[k].double().sum()
        q = draft_probs_KV[k].double() / draft_probs_KV[k].double().sum() if sampled else None
        accept = min(1.0, p[x].item() / q[x].item()) if sampled else p[x].item()
        if torch.rand((), generator=g).item() >= accept:
            if sampled:
                residual = (p - q).clamp(min=0.0)
            else:
                residual = p.clone()
                residual[x] = 0.0
            residual = residual / residual.sum().item()
            return tokens[:k], torch.multinomial(residual, 1, generator=g).item()
    p = target_probs_KV[len(tokens)].double()
    return tokens, torch.multinomial(p / p.sum().item(), 1, generator=g).item()


@pytest.mark.parametrize("seed", range(40))
def test_chain_tree_matches_reference_chain(seed):
    rng = random.Random(seed)
    vocab, length = 4, rng.randint(0, 5)
    g = torch.Generator().manual_seed(seed)
    tokens = [rng.randrange(vocab) for _ in range(length)]
    logits_KV = 2.0 * torch.randn(length + 1, vocab, generator=g)
    draft_probs_KV = (2.0 * torch.randn(length, vocab, generator=g)).softmax(-1)
    tree_greedy = chain(1, tokens)
    want = reference_chain_greedy(tokens, logits_KV)
    got = verify_greedy(tree_greedy, logits_KV)
    assert (got.tokens, got.bonus) == want and got.nodes == list(range(len(want[0]) + 1))

    probs_KV = process_logits(logits_KV, temperature=1.0)
    for sampled in (False, True):
        tree = chain(1, tokens, probs_KV=draft_probs_KV, sampled=sampled)
        want = reference_chain_sampling(tokens, probs_KV, draft_probs_KV, sampled, torch.Generator().manual_seed(seed))
        got = verify_sampling(tree, probs_KV, torch.Generator().manual_seed(seed))
        assert (got.tokens, got.bonus) == want and got.nodes == list(range(len(want[0]) + 1))


# ---- sampling is lossless: the committed tokens follow the target distribution -----------------------------------
#
# A toy language over V = 5 tokens: the target p(context) and the draft q(context) are fixed random distributions
# of the whole context (q correlated with p but clearly different). Each trial runs draft -> verify -> commit cycles
# from the same start until 3 tokens are committed; the empirical distributions of the first token, the first two
# and the first three must match the target's exact ones (chi-square). The same harness must reject verifiers
# with a planted bias, which shows the test has the power to fail. A second target is the first with a request's
# logit_bias and presence / frequency penalties (eyas.decoding.logits): the tree's rows are adjusted per node, the
# exact distribution one context at a time, as plain decoding would.

VOCAB, START, NUM_COMMITTED = 5, (0,), 3


@functools.lru_cache(maxsize=None)
def _logits(context: tuple[int, ...], salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((hash(context) * 31 + salt) % 2**31)
    return torch.randn(VOCAB, generator=g, dtype=torch.float64)


@functools.lru_cache(maxsize=None)
def target_p(context: tuple[int, ...]) -> torch.Tensor:
    return (1.5 * _logits(context, 1)).softmax(-1)


@functools.lru_cache(maxsize=None)
def draft_q(context: tuple[int, ...]) -> torch.Tensor:
    return (0.7 * _logits(context, 1) + 1.2 * _logits(context, 2)).softmax(-1)


@functools.lru_cache(maxsize=None)
def draft_q_list(context: tuple[int, ...]) -> list[float]:
    return draft_q(context).tolist()


@functools.lru_cache(maxsize=None)
def topk_tree(context: tuple[int, ...]) -> DraftTree:
    """(a) deterministic: the draft's top-2 at every node, 2 levels (6 drafted nodes)."""
    def expand(parent_ids, partial):
        return torch.stack([draft_q(context + tuple(partial.path_tokens(i)[1:])) for i in parent_ids])
    return build_static(context[-1], KARY(2, 2), expand)


def sampled_tree(context: tuple[int, ...], width: int, depth: int, rng: random.Random) -> DraftTree:
    """(b) width 1: a chain of `depth` tokens sampled from q; (c) width 2: every node gets 2 i.i.d. children."""
    tokens, parents, paths, rows = [context[-1]], [-1], [()], [torch.zeros(VOCAB, dtype=torch.float64)]
    layer = [0]
    for _ in range(depth):
        next_layer = []
        for parent in layer:
            ctx = context + paths[parent]
            for x in rng.choices(range(VOCAB), weights=draft_q_list(ctx), k=width):
                next_layer.append(len(tokens))
                tokens.append(x)
                parents.append(parent)
                paths.append(paths[parent] + (x,))
                rows.append(draft_q(ctx))
        layer = next_layer
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(len(tokens)), torch.stack(rows),
                     sampled=True)


def hybrid_tree(context: tuple[int, ...], rng: random.Random) -> DraftTree:
    """(d) the hybrid drafter's merge: two retrieved paths (fixed by the context, as lookup's are) over a chain of 3
    sampled from q, the best 4 nodes by value, declared deterministic (its q rows dropped)."""
    lookup = random.Random(hash(context))
    retrieved = from_paths(context[-1], [[lookup.randrange(VOCAB) for _ in range(2)] for _ in range(2)], [0.5, 0.5])
    sampled = sampled_tree(context, 1, 3, rng)
    v_N = [1.0]
    for i in range(1, sampled.num_nodes):
        v_N.append(v_N[-1] * sampled.draft_probs_NV[i, sampled.tokens_list[i]].item())
    return merge([("ngram", retrieved, [0.6 ** int(d) for d in retrieved.depth_N]), ("learned", sampled, v_N)], 4)


SUFFIX_CONFIG = SuffixConfig(depth=3, num_nodes=5, min_match=1, min_prob=0.0)


@functools.lru_cache(maxsize=1)
def suffix_history() -> SuffixIndex:
    """Earlier "answers" of the toy language for the suffix drafter: random, so its trees branch."""
    rng, index = random.Random(5), SuffixIndex(SUFFIX_CONFIG.anchors)
    for _ in range(30):
        index.add([rng.randrange(VOCAB) for _ in range(8)])
    return index


def suffix_tree(context: tuple[int, ...], rng: random.Random) -> DraftTree:
    """(e) the suffix drafter: the most frequent continuations of the context's longest suffix in the history and
    the context itself (deterministic given the context)."""
    drafter = SuffixDrafter(SUFFIX_CONFIG, history=suffix_history())
    drafter.begin(list(context), {})
    return drafter.propose(context[-1], list(context), 1.0, None)


TREES = {
    "topk_2x2": lambda context, rng: topk_tree(context),
    "hybrid": hybrid_tree,
    "suffix": suffix_tree,
    "sampled_chain_3": lambda context, rng: sampled_tree(context, 1, 3, rng),
    "sampled_iid_2x2": lambda context, rng: sampled_tree(context, 2, 2, rng),
}


def tree_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    paths = [()]
    for i in range(1, tree.num_nodes):
        paths.append(paths[tree.parents_list[i]] + (tree.tokens_list[i],))
    return paths


def target_rows(tree: DraftTree, context: tuple[int, ...]) -> torch.Tensor:
    return torch.stack([target_p(context + path) for path in tree_paths(tree)]).float()  # a caller's float32 probs


# strong settings, so that a node's own path (a repeated token) moves its row a lot
PENALISED = SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0, logit_bias=((3, 1.0),))


def penalised_rows(tree: DraftTree, context: tuple[int, ...]) -> torch.Tensor:
    """The engine's way: the tree's raw rows, adjusted per node with the tokens generated before it."""
    logits_NV = torch.stack([1.5 * _logits(context + path, 1) for path in tree_paths(tree)]).float()
    return process_logits(adjusted_logits(logits_NV, PENALISED, context[len(START):], tree), PENALISED.temperature)


@functools.lru_cache(maxsize=None)
def penalised_p(context: tuple[int, ...]) -> torch.Tensor:
    """Plain decoding's way: one context at a time."""
    logits_1V = (1.5 * _logits(context, 1))[None].float()
    return process_logits(adjusted_logits(logits_1V, PENALISED, context[len(START):]), PENALISED.temperature)[0]


TARGETS = {"plain": (target_rows, target_p), "penalised": (penalised_rows, penalised_p)}


def committed_prefixes(kind: str, num_trials: int, seed: int, target: str = "plain") -> Counter:
    """First NUM_COMMITTED committed tokens of each trial, over as many verify cycles as that takes."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = TARGETS[target][0]
    counts: Counter = Counter()
    for _ in range(num_trials):
        context = START
        while len(context) - len(START) < NUM_COMMITTED:
            tree = TREES[kind](context, rng)
            context += tuple(verify_sampling(tree, rows(tree, context), g).committed)
        counts[context[len(START):len(START) + NUM_COMMITTED]] += 1
    return counts


def exact_prob(prefix: tuple[int, ...], target: str = "plain") -> float:
    prob, context = 1.0, START
    for x in prefix:
        prob *= TARGETS[target][1](context)[x].item()
        context += (x,)
    return prob


def chi2_pvalues(counts: Counter, target: str = "plain") -> list[float]:
    """p-values for the first token, the first two and the first three, cells with < 5 expected merged."""
    num_trials, pvalues = sum(counts.values()), []
    for length in range(1, NUM_COMMITTED + 1):
        marginal: Counter = Counter()
        for prefix, c in counts.items():
            marginal[prefix[:length]] += c
        cells = sorted(set(marginal) | {p for p in _all_prefixes(length)})
        expected = [num_trials * exact_prob(c, target) for c in cells]
        observed = [marginal[c] for c in cells]
        big = [i for i, e in enumerate(expected) if e >= 5]
        small = [i for i, e in enumerate(expected) if e < 5]
        f_exp = [expected[i] for i in big] + ([sum(expected[i] for i in small)] if small else [])
        f_obs = [observed[i] for i in big] + ([sum(observed[i] for i in small)] if small else [])
        scale = num_trials / sum(f_exp)  # float round-off only
        pvalues.append(chisquare(f_obs, [e * scale for e in f_exp]).pvalue)
    return pvalues


def _all_prefixes(length: int) -> list[tuple[int, ...]]:
    prefixes = [()]
    for _ in range(length):
        prefixes = [p + (x,) for p in prefixes for x in range(VOCAB)]
    return prefixes


NUM_TRIALS = 4000


@pytest.mark.parametrize("kind", list(TREES))
def test_sampling_is_lossless(kind):
    pvalues = chi2_pvalues(committed_prefixes(kind, NUM_TRIALS, seed=1234))
    assert min(pvalues) > 1e-3, f"{kind}: committed tokens do not follow the target (p-values {pvalues})"


@pytest.mark.parametrize("kind", ["topk_2x2", "sampled_iid_2x2"])
def test_sampling_with_penalties_is_lossless(kind):
    pvalues = chi2_pvalues(committed_prefixes(kind, NUM_TRIALS, 1234, "penalised"), "penalised")
    assert min(pvalues) > 1e-3, f"{kind}: committed tokens do not follow the penalised target (p-values {pvalues})"


def test_the_same_test_rejects_penalties_that_ignore_the_nodes_path(monkeypatch):
    from eyas.decoding import logits

    counts = logits._counts
    monkeypatch.setattr(logits, "_counts", lambda generated, tree, device: counts(generated, None, device)
                        if tree is None else _root_counts(counts(generated, None, device), tree.num_nodes))
    pvalues = chi2_pvalues(committed_prefixes("topk_2x2", NUM_TRIALS, 1234, "penalised"), "penalised")
    assert min(pvalues) < 1e-6, f"a root-only penalty went undetected (p-values {pvalues})"


def _root_counts(ids_and_counts, num_nodes: int):
    """A bug: every node gets the root's counts (the tokens generated before the cycle), not its own path's."""
    ids_U, counts_1U = ids_and_counts
    return ids_U, counts_1U.expand(num_nodes, -1)


def _no_residual(target_p_V, draft_q_V):
    return target_p_V  # bug: after a rejection, resample from p instead of norm(max(0, p - q))


def _keep_rejected(target_p_V, token):
    return target_p_V  # bug: a rejected deterministic candidate can still come back as the bonus


def _overaccept(target_px, draft_qx):
    return min(1.0, 1.2 * target_px / draft_qx)  # bug: accept if u < 1.2 p/q


@pytest.mark.parametrize("kind,name,bug", [
    ("sampled_iid_2x2", "_residual", _no_residual),
    ("sampled_chain_3", "_accept_probability", _overaccept),
    ("topk_2x2", "_without", _keep_rejected),
    ("topk_2x2", "_accept_probability", _overaccept),
    ("hybrid", "_without", _keep_rejected),
])
def test_the_same_test_rejects_a_biased_verifier(kind, name, bug, monkeypatch):
    monkeypatch.setattr(verify, name, bug)
    pvalues = chi2_pvalues(committed_prefixes(kind, NUM_TRIALS, seed=1234))
    assert min(pvalues) < 1e-6, f"{kind} with {bug.__name__}: bias not detected (p-values {pvalues})"


# ---- helpers ----------------------------------------------------------------------------------------------------

def test_process_logits():
    logits_2V = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(process_logits(logits_2V, 1.0), logits_2V.softmax(-1))
    assert torch.allclose(process_logits(logits_2V, 0.5), (logits_2V / 0.5).softmax(-1))
    top2_V = torch.zeros(4)
    top2_V[:2] = torch.tensor([2.0, 1.0]).softmax(-1)
    assert torch.allclose(process_logits(logits_2V[:1], 1.0, top_k=2)[0], top2_V)
    full = logits_2V[0].softmax(-1)  # [0.644, 0.237, 0.087, 0.032]
    nucleus = process_logits(logits_2V[:1], 1.0, top_p=0.8)[0]  # 0.644 < 0.8 -> keep the second; then >= 0.8
    assert (nucleus[2:] == 0).all() and torch.allclose(nucleus[:2], full[:2] / full[:2].sum())
    assert (process_logits(logits_2V[:1], 1.0, top_p=0.5)[0] > 0).tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="temperature"):
        process_logits(logits_2V, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        process_logits(logits_2V, 1.0, top_p=0.0)


# top_p values that round to 0 in float32 (5e-324, 1e-46) dropped every token before the top token was pinned
TINY_TOP_P = st.sampled_from([5e-324, 1e-300, 1e-46, 1e-12, 1e-9])


@settings(max_examples=200, deadline=None)
@given(logits=st.lists(st.floats(-30.0, 30.0, width=32), min_size=1, max_size=40),
       temperature=st.floats(0.05, 5.0), top_p=TINY_TOP_P | st.floats(1e-6, 1.0, exclude_min=True),
       top_k=st.integers(0, 45))
@example(logits=[0.0, 1.401298464324817e-45], temperature=2.0, top_p=5e-324, top_k=0)
def test_process_logits_is_a_distribution_that_keeps_the_top_token(logits, temperature, top_p, top_k):
    logits_V = torch.tensor(logits)
    probs_V = process_logits(logits_V[None], temperature, top_p, top_k)[0]
    assert torch.isfinite(probs_V).all() and (probs_V >= 0).all()
    assert abs(probs_V.sum().item() - 1.0) < 1e-5
    # the top token of the distribution process_logits defines, softmax(logits / temperature): dividing can tie two
    # logits that differed (hypothesis found [0.0, 1.4e-45] at temperature 2: 1.4e-45 / 2 rounds to 0 in float32)
    scaled_V = logits_V / temperature
    top_V = scaled_V == scaled_V.max()
    assert probs_V[top_V].sum() > 0  # a top token (one of them, on a tie) always stays
    if top_p <= 1e-9:  # the nucleus is the top token alone
        assert (probs_V > 0).sum() == 1 and top_V[probs_V.argmax()]
        assert sample(probs_V, torch.Generator().manual_seed(0)) == int(probs_V.argmax())


def test_sample_follows_probs():
    g = torch.Generator().manual_seed(0)
    counts = Counter(sample(torch.tensor([0.2, 0.0, 0.8]), g) for _ in range(2000))
    assert counts[1] == 0 and 1500 < counts[2] < 1700


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.integers(1, 6),
       st.sampled_from([10, 4096, 8192, 8193, 49152, 50000]), st.integers(0, 2**31 - 1), st.integers(1, 40))
@example(torch.bfloat16, 3, 50000, 0, 1)
def test_argmax_rows_is_argmax(dtype, num_rows, vocab, seed, levels):
    """The two-pass argmax picks torch's index in every row: the first maximum, ties across chunks, inside the short
    last chunk and between whole rows of one value included (few distinct values make ties common)."""
    generator = torch.Generator().manual_seed(seed)
    scores_NV = torch.randint(levels, (num_rows, vocab), generator=generator).to(dtype)
    scores_NV[0, -1] = levels  # a row whose max is the very last score
    if num_rows > 1:
        scores_NV[1] = 0.0     # a row of one value: index 0
    assert verify.argmax_rows(scores_NV).tolist() == scores_NV.argmax(dim=-1).tolist()
    assert verify.argmax_rows(scores_NV[:, ::2]).tolist() == scores_NV[:, ::2].argmax(dim=-1).tolist()  # strided
