"""Drafting with a draft head (:mod:`specinfer.models.head_drafter`): its tree passes compute what the head's
teacher-forced forward computes on the same pairs; its state follows the committed tokens (a request that
goes back drafts as if it had never gone further); through the in-process engine on the demo LLM, greedy
output with head trees (alone, merged with an SSM's) equals plain decoding, and seeded sampling too."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from oracles import hf_greedy, hf_seeded_sampling  # noqa: E402  tests/oracles.py
from test_stochastic_engine import free_speculation  # noqa: E402  tests/test_stochastic_engine.py

from specinfer.core import SamplingParams  # noqa: E402
from specinfer.core.errors import InvalidArgument  # noqa: E402
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine  # noqa: E402
from specinfer.models.draft_head import DraftHead, HeadConfig, save_head  # noqa: E402
from specinfer.models.head_drafter import HeadDrafter, with_head  # noqa: E402
from specinfer.models.interface import TreeForward  # noqa: E402
from specinfer.models.loading import eos_token_id, load_backend  # noqa: E402

F, V = 16, 40


def _random_head(feature_dim: int = F, vocab: int = V, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig(feature_dim, vocab, hidden=24, heads=4, kv_heads=2, head_dim=6, intermediate=32))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return head.eval().requires_grad_(False)


@pytest.fixture(params=["pytorch", "cpu-kernels"])
def drafter(request):
    """A drafter whose head's products are PyTorch's, or the CPU kernels' own (as on a CPU with them built)."""
    torch.manual_seed(1)
    unembed, embed = torch.randn(V, F), torch.randn(V, F)
    head = _random_head()
    if request.param == "cpu-kernels" and not head.cpu_products(2):
        pytest.skip("the CPU kernels are not built here")
    drafter = HeadDrafter(head, lambda proj, rows: lambda x: x @ (unembed @ proj).T, lambda t: embed[t])
    drafter.unembed = unembed  # the LM head, for the tests' own teacher-forced logits
    # the kernels reduce in another order than PyTorch's products (fp32 rounding apart)
    drafter.tolerance = {"rtol": 1e-4, "atol": 1e-4} if request.param == "cpu-kernels" else {}
    return drafter


def test_tree_passes_are_the_teacher_forced_forward(drafter):
    """A root and two children, then a grandchild: each node's logits are those of the head run over the
    committed pairs, then its path's pairs (each drafted token with its parent's predicted feature)."""
    committed = [3, 9, 4, 22, 7]
    feats = torch.randn(len(committed), F)
    drafter.absorb("r", committed, 0, feats)
    root, kids, grandkid = 11, (5, 6), 30
    (root_logits,) = drafter.forward_tree([TreeForward("r", committed, [root], [-1])])
    (kid_logits,) = drafter.forward_tree([TreeForward("r", committed, list(kids), [0, 0])])
    (gk_logits,) = drafter.forward_tree([TreeForward("r", committed, [grandkid], [1])])  # under kids[0] (node 1)
    head, embed, unembed = drafter.head, drafter.embed_rows, lambda f: f @ drafter.unembed.T

    def run(pair_feats, next_tokens):  # teacher-forced over one sequence of pairs
        return head(torch.stack(pair_feats)[None], embed(torch.tensor(next_tokens))[None])[0]

    base_f, base_t = [feats[j] for j in range(len(committed))], [*committed[1:], root]
    pred = run(base_f, base_t)
    torch.testing.assert_close(root_logits, unembed(pred[-1:]), **drafter.tolerance)
    for i, kid in enumerate(kids):  # siblings do not see each other
        pred_kid = run([*base_f, pred[-1]], [*base_t, kid])
        torch.testing.assert_close(kid_logits[i : i + 1], unembed(pred_kid[-1:]), **drafter.tolerance)
    pred_kid = run([*base_f, pred[-1]], [*base_t, kids[0]])
    pred_gk = run([*base_f, pred[-1], pred_kid[-1]], [*base_t, kids[0], grandkid])
    torch.testing.assert_close(gk_logits, unembed(pred_gk[-1:]), **drafter.tolerance)


def test_state_follows_the_committed_tokens(drafter):
    """Absorbing in steps, with holes (positions the LLM did not compute) and after going back, drafts what the
    same pairs absorbed at once do."""
    committed = [3, 9, 4, 22, 7, 8, 1, 2]
    feats = torch.randn(len(committed), F)
    fresh = HeadDrafter(drafter.head, lambda proj, rows: drafter.logits, drafter.embed_rows)
    fresh.absorb("r", committed, 0, feats)
    drafter.absorb("r", committed[:4], 0, feats[:4])
    drafter.absorb("r", [*committed[:4], 30, 31], 4, torch.randn(2, F))  # a path that is then dropped
    drafter.absorb("r", committed, 4, feats[4:])  # back to position 4: pair 3's token changes too
    assert drafter.can_draft("r", committed) and not drafter.can_draft("r", committed[:-1])
    item = [TreeForward("r", committed, [5], [-1])]
    torch.testing.assert_close(drafter.forward_tree(item)[0], fresh.forward_tree(item)[0])
    with pytest.raises(ValueError, match="must end at the last committed token"):
        drafter.absorb("r", committed, 0, feats[:3])


NEW_TOKENS = 32
SPECS = {
    "head-alone": SpeculationConfig(None, ssms=(), suffix=False, head=True),
    "head-and-ssm": SpeculationConfig(None, ssms=(0,), suffix=True, head=True),
}


@pytest.fixture(scope="module")
def head_engine(model_pair, tmp_path_factory):
    """The demo LLM with a head (the trained demo head where the repository has one, else a random one:
    exactness does not depend on what the head drafts)."""
    head_dir = model_pair.llm.parent / "head"
    llm = load_backend(model_pair.llm, "llm", "float32", backend="native", kv_cache_bytes=1 << 27)
    if not (head_dir / "config.json").is_file():
        head_dir = tmp_path_factory.mktemp("head")
        save_head(_random_head(llm.feature_dim, llm.vocab_size), head_dir)
    ssm = load_backend(model_pair.ssm, "ssm", "float32", backend="native", kv_cache_bytes=1 << 27)
    config = EngineConfig(eos_token_id=eos_token_id(model_pair.llm))
    return SpeculativeEngine(with_head(llm, head_dir, model_pair.llm), [ssm], config, free_speculation())


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_with_head_trees_is_transformers(model_pair, head_engine, name):
    prompts = [tuple(p[:40]) for p in model_pair.prompts[:3]]
    expected = hf_greedy(model_pair.llm, prompts, NEW_TOKENS, ignore_eos=True)
    requests = [
        GenerationRequest(f"{name}-{i}", p, NEW_TOKENS, speculation=SPECS[name], ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    assert [list(r.output_tokens) for r in head_engine.generate(requests)] == expected
    assert head_engine.adaptive.totals.drafter_steps.get("head", 0) > 0, "head trees were verified"


def test_seeded_sampling_with_head_trees_is_plain_decodings(model_pair, head_engine):
    prompts = [tuple(p[:40]) for p in model_pair.prompts[:2]]
    params, seeds = SamplingParams(temperature=0.8), (5, 6)
    expected = hf_seeded_sampling(model_pair.llm, prompts, seeds, params, NEW_TOKENS, ignore_eos=True)
    requests = [
        GenerationRequest(
            f"seeded-{i}", p, NEW_TOKENS, dataclasses.replace(params, seed=s), SPECS["head-and-ssm"], ignore_eos=True
        )
        for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))
    ]
    assert [list(r.output_tokens) for r in head_engine.generate(requests)] == expected


def test_a_head_that_does_not_fit_is_refused(model_pair, tmp_path):
    llm = load_backend(model_pair.llm, "llm", "float32", backend="native", kv_cache_bytes=1 << 26)
    save_head(_random_head(llm.feature_dim + 8, llm.vocab_size), tmp_path / "wide")
    with pytest.raises(InvalidArgument, match=r"head.*features of width"):
        with_head(llm, tmp_path / "wide")
    with pytest.raises(InvalidArgument, match="not a draft-head folder"):
        with_head(llm, model_pair.llm)


def test_a_head_that_costs_more_than_it_returns_is_switched_off(model_pair, monkeypatch):
    """A head whose every pass is made 20 ms slower loses to plain steps in the head gate's measurements at batch
    1 (:mod:`specinfer.core.head_gate`): after a block with it and one without, steps stop asking it, and greedy
    output stays plain decoding's."""
    import time

    llm = load_backend(model_pair.llm, "llm", "float32", backend="native", kv_cache_bytes=1 << 26)
    head_dir = model_pair.llm.parent / "head"
    if not (head_dir / "config.json").is_file():
        head_dir = model_pair.llm.parent / "random-head"
        save_head(_random_head(llm.feature_dim, llm.vocab_size), head_dir)
    engine = SpeculativeEngine(
        with_head(llm, head_dir, model_pair.llm), [], EngineConfig(eos_token_id=None), free_speculation()
    )
    passes = []

    def slowed(name):  # greedy passes of a head with a draft vocabulary call forward_tree_columns, others forward_tree
        inner = getattr(engine.llm.head, name)

        def slow(batch):
            passes.append(len(batch))
            time.sleep(0.02)
            return inner(batch)

        monkeypatch.setattr(engine.llm.head, name, slow)

    slowed("forward_tree")
    slowed("forward_tree_columns")
    prompt = tuple(model_pair.prompts[0][:30])
    first = engine.generate([GenerationRequest("a", prompt, 80, speculation=SPECS["head-alone"], ignore_eos=True)])
    gate = engine.head_gate
    on, off = gate.rates(1)
    assert 0 < on < off
    asked = len(passes)
    second = engine.generate([GenerationRequest("b", prompt, 30, speculation=SPECS["head-alone"], ignore_eos=True)])
    assert len(passes) == asked, "the head was asked again though it did not pay"
    expected = hf_greedy(model_pair.llm, [prompt], 80, ignore_eos=True)[0]
    assert list(first[0].output_tokens) == expected and list(second[0].output_tokens) == expected[:30]


def test_a_head_kept_up_between_its_trees_drafts_as_one_asked_every_step(model_pair, tmp_path):
    """Steps that do not ask the head for a tree still give it their features (a HeadDraft without a budget): after
    four such steps its next tree is the one a head asked every step drafts, with a pair for every committed
    token; steps without any HeadDraft leave those pairs out (the hole keeping up closes)."""
    from specinfer.core import DraftTree, TokenTree
    from specinfer.core.dynamic_trees import TreeBudget
    from specinfer.core.iteration import HeadDraft, VerifySpec
    from specinfer.models.verification import verify_trees

    llm = load_backend(model_pair.llm, "llm", "float32", backend="native", kv_cache_bytes=1 << 26)
    head_dir = model_pair.llm.parent / "head"
    if not (head_dir / "config.json").is_file():
        head_dir = tmp_path / "head"
        save_head(_random_head(llm.feature_dim, llm.vocab_size), head_dir)
    headed = with_head(llm, head_dir, model_pair.llm)
    ask, keep_up = HeadDraft(TreeBudget(8, 4, 4, 0.0), 8), HeadDraft(None, 8)

    def run(name: str, asks: list) -> tuple:
        committed = list(model_pair.prompts[0][:30])
        for step, head in enumerate(asks):
            root = DraftTree(TokenTree((committed[-1],), (-1,)), ())
            spec = VerifySpec(name, committed[:-1], root, SamplingParams(), 0, step, head)
            (result,) = verify_trees(headed, [spec])
            assert (result.next_tree is not None) == (head is not None and head.budget is not None)
            committed += [*result.accepted_tokens, result.bonus_token]
        tree = result.next_tree.tree
        return (tree.tokens, tree.parents), list(headed.head._states[name].positions), len(committed)

    every, pairs, length = run("every", [ask] * 6)
    assert pairs == list(range(length - 2))  # pair j: the feature at j and token j + 1, up to the bonus's parent
    assert run("kept-up", [ask, *[keep_up] * 4, ask]) == (every, pairs, length)
    _, holed, _ = run("not-kept", [ask, *[None] * 4, ask])
    assert len(holed) == len(pairs) - 4
