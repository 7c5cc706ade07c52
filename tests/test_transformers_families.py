"""transformers families through our flex lowering on the CPU stand-ins (flex_support.py; the
backward's from test_flex_backward_lowering.py): a decode step given generate()'s padded attention
mask, a prefill and a training step of Gemma-2/3 (softcap, sliding windows, head dim 256), Mistral,
DeepSeek-V3 (MLA 192/128, MoE), Qwen3-MoE and SmolLM3 (layers without RoPE), and Llama training
on packed documents (transformers' document mask from restarting position ids). Every attention call
takes our ops, the step is one graph where it should be, and logits (or loss and gradients) match
the same weights with eager attention. GPU twin (every family, the kernels):
tests/gpu/test_transformers_families_gpu.py."""

import pytest
import torch

import transformers_families as tf
from flex_support import OUR_CALL, OUR_PREFILL_CALL, cpu_accepted, decisions  # noqa: F401
from test_flex_backward_lowering import accept_cpu_training

pytest.importorskip("transformers")
OUR_BACKWARD_CALL = "inductor_cute.inductor.flex.runtime.FlexBackwardLauncher("


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "deepseek_v3", "qwen3_moe", "smollm3"])
def test_a_padded_decode_step_is_one_graph_of_our_op(cpu_accepted, decisions, name):
    config, model = tf.build(name, "flex_attention")
    _, twin = tf.build(name, "eager")  # the same weights
    with tf.routing_recorded(twin) as routing:
        ref = tf.decode_logits(twin, config, twin, 100, 128)
    with tf.routing_pinned(model, routing):
        ours, code = tf.compile_and_run(lambda compile: tf.decode_logits(twin, config, compile(model), 100, 128))
    assert code.count(OUR_CALL) == 2 and code.count("# AOT ID:") == 1
    assert [reason for _, reason in decisions] == [None, None]
    tf.assert_tokens_agree(ours, ref)


@pytest.mark.parametrize("name", ["gemma2", "deepseek_v3"])
def test_a_prefill_runs_our_prefill_op(cpu_accepted, decisions, name):
    _, model = tf.build(name, "flex_attention")
    _, twin = tf.build(name, "eager")
    with tf.routing_recorded(twin) as routing:
        ref = tf.prefill_logits(twin, 160)
    with tf.routing_pinned(model, routing):
        ours, code = tf.compile_and_run(lambda compile: tf.prefill_logits(compile(model), 160), flex_prefill=True)
    assert code.count(OUR_PREFILL_CALL) == 2 and [reason for _, reason in decisions] == [None, None]
    tf.assert_tokens_agree(ours, ref)


@pytest.mark.parametrize("name, packed", [("mistral", False), ("deepseek_v3", False),  # no backward at d256
                                          ("llama", True)])
def test_a_training_step_runs_our_forward_and_backward(monkeypatch, decisions, name, packed):
    """`packed`: two documents per row (position ids restarting), so a document mask: the loss
    is the packed one eager attention computes, not the unpacked one."""
    accept_cpu_training(monkeypatch)
    _, model = tf.build(name, "flex_attention")
    ours, code = tf.compile_and_run(lambda compile: tf.train_step(model, compile(model), 160, packed=packed),
                                    flex_prefill=True, flex_backward=True)
    assert code.count(OUR_PREFILL_CALL) == 2 and code.count(OUR_BACKWARD_CALL) == 2
    assert all(reason is None for _, reason in decisions)
    _, model = tf.build(name, "eager")
    torch.testing.assert_close(ours, tf.train_step(model, model, 160, packed=packed), atol=0, rtol=1e-2)
    if packed:
        assert not torch.allclose(ours, tf.train_step(model, model, 160), atol=0, rtol=1e-5)
