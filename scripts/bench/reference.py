"""The hand-written Flax NNX + optax loop W1 is compared with (--reference)."""

from __future__ import annotations

import time


class ReferenceStep:
    """The hand-written loop W1 is compared with: Flax NNX modules (nnx.Linear projections,
    nnx.RMSNorm, SwiGLU, tied embeddings, no RoPE), jax.nn.dot_product_attention(is_causal=True),
    optax.adamw and optax.softmax_cross_entropy_with_integer_labels, in one jax.jit."""

    def __init__(self, cfg, device, batch_size: int) -> None:
        import functools

        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from flax import nnx

        m = cfg.model
        heads, kv_heads, head_dim = m.num_heads, m.num_kv_heads, m.head_dim

        class Block(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
                self.attn_norm = nnx.RMSNorm(m.d_model, rngs=rngs)
                self.q = linear(m.d_model, heads * head_dim)
                self.k = linear(m.d_model, kv_heads * head_dim)
                self.v = linear(m.d_model, kv_heads * head_dim)
                self.o = linear(heads * head_dim, m.d_model)
                self.mlp_norm = nnx.RMSNorm(m.d_model, rngs=rngs)
                self.gate = linear(m.d_model, m.mlp_dim)
                self.up = linear(m.d_model, m.mlp_dim)
                self.down = linear(m.mlp_dim, m.d_model)

            def __call__(self, x):
                b, t, _ = x.shape
                h = self.attn_norm(x)
                q = self.q(h).reshape(b, t, heads, head_dim)
                k = self.k(h).reshape(b, t, kv_heads, head_dim)
                v = self.v(h).reshape(b, t, kv_heads, head_dim)
                attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
                x = x + self.o(attended.reshape(b, t, heads * head_dim))
                h = self.mlp_norm(x)
                return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))

        class Model(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.embed = nnx.Embed(m.vocab_size, m.d_model, rngs=rngs)
                self.blocks = nnx.List([Block(rngs) for _ in range(m.num_layers)])
                self.norm = nnx.RMSNorm(m.d_model, rngs=rngs)

            def __call__(self, tokens):
                x = self.embed(tokens)
                for block in self.blocks:
                    x = block(x)
                return self.embed.attend(self.norm(x))

        t = cfg.training
        tx = optax.adamw(t.learning_rate, b1=t.adam_b1, b2=t.adam_b2, weight_decay=t.weight_decay)
        with jax.default_device(device):
            graphdef, params = nnx.split(Model(nnx.Rngs(t.seed)))
            opt_state = tx.init(params)

        def loss_fn(params, tokens):
            logits = nnx.merge(graphdef, params)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        start = time.perf_counter()
        tokens_shape = jax.ShapeDtypeStruct((batch_size, cfg.data.seq_len + 1), jnp.int32)
        self.compiled = step.lower(params, opt_state, tokens_shape).compile()
        self.compile_s = time.perf_counter() - start
        self.params, self.opt_state = params, opt_state
        rng = np.random.default_rng(t.seed)
        self._batch = lambda: jax.device_put(
            rng.integers(0, m.vocab_size, (batch_size, cfg.data.seq_len + 1), dtype=np.int32),
            device,
        )
        self._jax = jax

    def __call__(self) -> None:
        self.params, self.opt_state, loss = self.compiled(
            self.params, self.opt_state, self._batch()
        )
        self._jax.block_until_ready((self.params, self.opt_state, loss))
