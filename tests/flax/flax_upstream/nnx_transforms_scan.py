# Copyright 2024 The Flax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

# Vendored from Flax 0.12.12 (https://github.com/google/flax, tests/nnx/transforms_test.py;
# identical in 0.12.8 for these tests), Copyright 2024 The Flax Authors, Apache License 2.0.
# Selected: every test method that uses nnx.scan (TestScan, and the scan tests of TestRemat and
# TestBoundMethodTransforms), verbatim. Changes: only the selection, and the module's
# `os.environ['XLA_FLAGS'] = ...` line dropped (jaxmem's tests/conftest.py sets XLA_FLAGS).
# tests/flax/test_flax_nnx_upstream.py runs these with jaxmem.flax.nnx.scan in place of nnx.scan.
# ruff: noqa
# fmt: off

import dataclasses
from functools import partial
import typing as tp

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
from flax.nnx.transforms import general
import jax
from jax.experimental import checkify, mesh_utils
import jax.numpy as jnp
import numpy as np
import optax


class TestScan(parameterized.TestCase):
  def test_basic(self):
    class Block(nnx.Module):
      def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)

      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = nnx.gelu(x)
        return x

    @nnx.split_rngs(splits=5)
    @nnx.scan(in_axes=(nnx.Carry, 0), length=5)
    def create_block(_, rngs: nnx.Rngs):
      return None, Block(rngs=rngs)

    _, module = create_block(None, nnx.Rngs(0))

    assert module.linear.kernel.shape == (5, 3, 3)
    assert module.linear.bias.shape == (5, 3)

    @nnx.scan(in_axes=(nnx.Carry, 0, None), length=5)
    def forward_block(_, block: Block, x: jax.Array):
      return None, block(x)

    x = jnp.ones((1, 3))
    out, y = forward_block(None, module, x)

    assert y.shape == (5, 1, 3)
    assert out is None

  def test_broadcast_args(self):
    def scale_cumsum(carry, scale, x):
      carry = carry + x * scale
      return carry, carry

    final_carry, _ = nnx.scan(
        scale_cumsum,
        in_axes=(nnx.Carry, None, 0),
        out_axes=(nnx.Carry, 0),
        graph=False,
    )(jnp.array(0.0), jnp.array(2.0), jnp.arange(5.0))
    np.testing.assert_allclose(final_carry, 20.0)

  def test_no_carry_all_scanned(self):
    def double(x):
      return x * 2

    ys = nnx.scan(
        double, in_axes=0, out_axes=0, graph=False
    )(jnp.arange(5.0))
    np.testing.assert_allclose(ys, jnp.arange(5.0) * 2)

  def test_pytree_prefix_in_axes(self):
    def fn(carry, x):
      carry = carry + x['a'] + x['b']
      return carry, carry

    xs = {'a': jnp.arange(3.0), 'b': jnp.array(1.0)}
    final_carry, _ = nnx.scan(
        fn,
        in_axes=(nnx.Carry, {'a': 0, 'b': None}),
        out_axes=(nnx.Carry, 0),
        graph=False,
    )(jnp.array(0.0), xs)
    np.testing.assert_allclose(final_carry, 6.0)

  def test_nested_carry_rejected(self):
    with self.assertRaises(ValueError):
      nnx.scan(
          lambda x: x,
          in_axes=({'a': nnx.Carry},),
          out_axes=nnx.Carry,
          graph=False,
      )({'a': jnp.array(1.0)})

  @parameterized.parameters(True, False)
  def test_broadcast_out_axes_rejected1(self, graph):
    with self.assertRaisesRegex(ValueError, 'Cannot broadcast output state'):
      nnx.scan(
          lambda c, x: (c, x),
          in_axes=(nnx.Carry, 0),
          out_axes=(nnx.Carry, None),
          graph=graph,
          graph_updates=False,
      )(jnp.array(0.0), jnp.arange(3.0))

  def test_none_broadcast_input(self):
    def fn(carry, _unused, x):
      carry = carry + x
      return carry, carry

    final_carry, _ = nnx.scan(
        fn,
        in_axes=(nnx.Carry, None, 0),
        out_axes=(nnx.Carry, 0),
        graph=False,
    )(jnp.array(0.0), None, jnp.arange(3.0))
    np.testing.assert_allclose(final_carry, 3.0)

  def test_none_nested_in_arg(self):
    def fn(carry, x):
      carry = carry + x['a']
      return carry, carry

    xs = {'a': jnp.arange(3.0), 'b': None}
    final_carry, _ = nnx.scan(
        fn,
        in_axes=(nnx.Carry, 0),
        out_axes=(nnx.Carry, 0),
        graph=False,
    )(jnp.array(0.0), xs)
    np.testing.assert_allclose(final_carry, 3.0)

  def test_nested_carry_in_out_axes_rejected(self):
    with self.assertRaises(ValueError):
      nnx.scan(
          lambda c, x: (c, x),
          in_axes=(nnx.Carry, 0),
          out_axes=({'a': nnx.Carry},),
          graph=False,
      )(jnp.array(0.0), jnp.arange(3.0))

  def test_carry_in_in_axes_only_rejected(self):
    with self.assertRaisesRegex(ValueError, 'If one of in_axes or out_axes has Carry'):
      nnx.scan(
          lambda c, x: (c + x,),
          in_axes=(nnx.Carry, 0),
          out_axes=(0,),
          graph=False,
      )(jnp.array(0.0), jnp.arange(3.0))

  def test_carry_in_out_axes_only_rejected(self):
    with self.assertRaisesRegex(ValueError, 'If one of in_axes or out_axes has Carry'):
      nnx.scan(
          lambda x: x,
          in_axes=(0,),
          out_axes=nnx.Carry,
          graph=False,
      )(jnp.arange(3.0))

  def test_non_tuple_carry_only(self):
    def f(carry):
      return carry + 1

    result = nnx.scan(
        f,
        in_axes=nnx.Carry,
        out_axes=nnx.Carry,
        length=5,
        graph=False,
    )(jnp.array(0))
    self.assertEqual(result, 5)

  def test_non_tuple_scan_only(self):
    def f(x):
      return x * 2

    ys = nnx.scan(
        f,
        in_axes=0,
        out_axes=0,
        graph=False,
    )(jnp.arange(5.0))
    np.testing.assert_allclose(ys, jnp.arange(5.0) * 2)

  @parameterized.parameters(True, False)
  def test_variables_in_scan(self, graph_updates):
    def block_init(din, dout, rngs):
      w = nnx.Param(jax.random.normal(rngs.params(), (din, dout)))
      b = nnx.Param(jnp.zeros((dout,)))
      return w, b

    def block_forward(w, b, x):
      return nnx.gelu(x @ w + b[None])

    @nnx.split_rngs(splits=5)
    @nnx.scan(in_axes=0, out_axes=0, length=5, graph_updates=graph_updates)
    def create_block(rngs: nnx.Rngs):
      return block_init(3, 3, rngs)

    w, b = create_block(nnx.Rngs(0))

    assert w.shape == (5, 3, 3)
    assert b.shape == (5, 3)

    @nnx.scan(
      in_axes=(0, 0, nnx.Carry), out_axes=nnx.Carry,
      graph_updates=graph_updates,
    )
    def stack_forward(w, b, x):
      return block_forward(w, b, x)

    x = jnp.ones((1, 3))
    y = stack_forward(w, b, x)
    assert y.shape == (1, 3)

  @parameterized.parameters(
    (True, True), (True, False), (False, False),
  )
  def test_variables_as_carries_in_scan(self, graph, graph_updates):
    w = nnx.Param(jax.random.normal(jax.random.key(0), (3, 3)))
    b = nnx.Param(jnp.zeros((3,)))
    count = nnx.BatchStat(0)

    def block_forward(w, b, x):
      return nnx.gelu(x @ w + b[None])

    @nnx.scan(
      in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0),
      graph=graph, graph_updates=graph_updates,
    )
    def stack_forward(params, x):
      w, b, count = params
      y = block_forward(w, b, x)
      count[...] += 1
      return (w, b, count), y

    x = jnp.ones((5, 1, 3))
    (w, b, count), y = stack_forward((w, b, count), x)

    assert y.shape == (5, 1, 3)
    assert count[...] == 5

  @parameterized.parameters(True, False)
  def test_variables_broadcast_in_scan(self, graph):
    w = nnx.Param(jax.random.normal(jax.random.key(0), (3, 3)))
    b = nnx.Param(jnp.zeros((3,)))
    count = nnx.BatchStat(0)

    def block_forward(w, b, x):
      return nnx.gelu(x @ w + b[None])

    @nnx.scan(
      in_axes=(None, None, None, 0), out_axes=0,
      graph=graph, graph_updates=False
    )
    def stack_forward(w, b, count, x):
      y = block_forward(w, b, x)
      count[...] += 1
      return y

    x = jnp.ones((5, 1, 3))
    y = stack_forward(w, b, count, x)

    assert y.shape == (5, 1, 3)
    assert count[...] == 5

  def test_basic_no_carry(self):
    class Block(nnx.Module):
      def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)

      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = nnx.gelu(x)
        return x

    @nnx.split_rngs(splits=5)
    @nnx.scan(in_axes=(0,), out_axes=0, length=5)
    def create_block(rngs: nnx.Rngs):
      return Block(rngs=rngs)

    module = create_block(nnx.Rngs(0))

    assert module.linear.kernel.shape == (5, 3, 3)
    assert module.linear.bias.shape == (5, 3)
    # assert module.node.shape == (2,)

    @nnx.scan(in_axes=(0, None), out_axes=0, length=5)
    def forward_block(block: Block, x: jax.Array):
      return block(x)

    x = jnp.ones((1, 3))
    y = forward_block(module, x)

    assert y.shape == (5, 1, 3)

  @parameterized.parameters(True, False)
  def test_all_carry(self, graph_updates):
    @dataclasses.dataclass
    class Foo(nnx.Module):
      n: nnx.BatchStat[int]

    foo = Foo(n=nnx.BatchStat(0))

    @nnx.scan(
      in_axes=nnx.Carry, out_axes=nnx.Carry, length=3,
      graph_updates=graph_updates,
    )
    def loop(foo: Foo):
      foo.n[...] += 1
      return foo

    foo2 = loop(foo)

    self.assertIs(foo2.n, foo.n)
    self.assertEqual(foo.n[...], 3)

  def test_all_carry_one_argument_error(self):
    @dataclasses.dataclass
    class Foo(nnx.Module):
      n: nnx.BatchStat[int]

    foo = Foo(n=nnx.BatchStat(0))

    @nnx.scan(in_axes=nnx.Carry, out_axes=nnx.Carry, length=3)
    def loop(foo: Foo, x):
      ...

    with self.assertRaisesRegex(
      ValueError,
      'When in_axes=Carry, the function must take exactly one argument',
    ):
      loop(foo, 0)

  @parameterized.parameters(True, False)
  def test_all_carry_new_reference_error(self, graph_updates):
    class Foo(nnx.Module):
      def __init__(self, n: nnx.BatchStat[int]):
        self.n = n

    xs = jnp.arange(3)
    foo = Foo(n=nnx.BatchStat(0))

    @nnx.scan(
        in_axes=(nnx.Carry, 0),
        out_axes=(nnx.Carry, 0),
        graph=True,
        graph_updates=graph_updates,
    )
    def loop(foo: Foo, x):
      x = x + 1
      foo = Foo(nnx.BatchStat(foo.n[...] + 1))  # new reference
      return foo, x

    msg = (
        'Carry references must be the same between iterations'
        if graph_updates
        else 'scan Variable identity must be preserved across iterations'
    )

    with self.assertRaisesRegex(ValueError, msg):
      loop(foo, xs)

  @parameterized.parameters(True, False)
  def test_all_scan(self, graph_updates):
    class Foo(nnx.Module):
      def __init__(self, n: nnx.BatchStat[jax.Array]):
        self.n = n

    xs = jnp.arange(3)
    foo = Foo(n=nnx.BatchStat(jnp.arange(3)))

    @nnx.scan(in_axes=0, out_axes=0, graph_updates=graph_updates)
    def loop(foo: Foo, x):
      x = x + 1
      foo.n[...] += 1
      return x

    ys = loop(foo, xs)

    np.testing.assert_allclose(ys, jnp.arange(1, 4))
    np.testing.assert_allclose(foo.n[...], jnp.arange(1, 4))

  def test_all_broadcast(self):
    @nnx.dataclass
    class Foo(nnx.Module):
      n: nnx.BatchStat[int]

    xs = jnp.array(1)
    foo = Foo(n=nnx.BatchStat(2))

    @nnx.scan(in_axes=None, out_axes=0, length=4)
    def loop(foo: Foo, x):
      return x + foo.n

    ys = loop(foo, xs)

    np.testing.assert_allclose(ys, 3)
    self.assertEqual(ys.shape, (4,))

  @parameterized.parameters(True, False)
  def test_input_output_carry_mismatch_error(self, graph_updates):
    with nnx.set_graph_updates(graph_updates):
      with self.assertRaisesRegex(
          ValueError,
          'If one of in_axes or out_axes has Carry, the other must also have'
          ' Carry',
      ):

        @nnx.scan(in_axes=0, out_axes=(nnx.Carry, 0))
        def loop(a, b):
          ...

      with self.assertRaisesRegex(
          ValueError,
          'If one of in_axes or out_axes has Carry, the other must also have'
          ' Carry',
      ):

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=0)
        def loop(a, b):
          ...

  @parameterized.parameters(True, False)
  def test_double_carry_error(self, graph_updates):
    with self.assertRaisesRegex(
      ValueError,
      'Found multiple Carry definitions',
    ):

      @nnx.scan(in_axes=(nnx.Carry, nnx.Carry), graph_updates=graph_updates)
      def loop(a, b):
        ...

  @parameterized.parameters(True, False)
  def test_broadcast_in_output_error(self, graph_updates):
    with self.assertRaisesRegex(
      ValueError,
      'Cannot broadcast output state',
    ):

      @nnx.scan(
          in_axes=(nnx.Carry, 0),
          out_axes=(nnx.Carry, None),
          graph_updates=graph_updates,
      )
      def loop(a, b):
        ...

  def test_broadcast_in_output_state_axes_error(self):
    with self.assertRaisesRegex(
      ValueError,
      'Cannot broadcast output state. Got StateAxes',
    ):

      @nnx.scan(
          in_axes=(nnx.Carry, 0),
          out_axes=(nnx.Carry, nnx.StateAxes({...: None})),
          graph=True,
          graph_updates=True,
      )
      def loop(a, b):
        ...

  @parameterized.parameters(
    (True, False), (False, False),
  )
  def test_scan_stateful(self, graph, graph_updates):
    count = nnx.Variable(jnp.array(0))

    @nnx.scan(graph=graph, graph_updates=graph_updates)
    def f(count, x):
      count[...] += 1
      return count, x + count[...]

    xs = jnp.arange(5)
    count_out, ys = f(count, xs)

    self.assertIs(count_out, count)
    self.assertEqual(count[...], 5)
    np.testing.assert_allclose(ys, jnp.array([1, 3, 5, 7, 9]))

  @parameterized.parameters(
    (True, False), (False, False),
  )
  def test_scan_carry_identity_error(self, graph, graph_updates):
    count = nnx.Variable(jnp.array(0))

    @nnx.scan(graph=graph, graph_updates=graph_updates)
    def f(count, x):
      new_count = nnx.Variable(count[...] + 1)
      return new_count, x

    with self.assertRaisesRegex(
      ValueError,
      'scan Variable identity must be preserved',
    ):
      f(count, jnp.arange(3))

  def test_tree_mode_custom_axes(self):
    @nnx.scan(in_axes=nnx.Carry, out_axes=nnx.Carry, length=3, graph=False)
    def loop(x):
      return x

    result = loop(jnp.array(1.0))
    np.testing.assert_allclose(result, jnp.array(1.0))

  @parameterized.parameters(True, False)
  def test_only_carry(self, graph_updates):
    class Foo(nnx.Module):
      def __init__(self):
        self.c = nnx.BatchStat(jnp.array(0))

    @nnx.scan(in_axes=(nnx.Carry,), length=5, graph_updates=graph_updates)
    def loop(foo: Foo) -> tuple[Foo, jax.Array]:
      foo.c[...] += 1
      return foo, foo.c[...]

    foo = Foo()
    foo2, cs = loop(foo)
    self.assertIs(foo2.c, foo.c)
    self.assertEqual(foo.c[...], 5)
    np.testing.assert_allclose(cs, jnp.arange(1, 6))

  @parameterized.parameters(True, False)
  def test_only_carry_functional(self, graph):
    class Foo(nnx.Module):
      def __init__(self):
        self.c = nnx.BatchStat(jnp.array(0))

    @nnx.scan(
        in_axes=None, out_axes=0, length=5, graph=graph, graph_updates=False
    )
    def loop(foo: Foo) -> tuple[Foo, jax.Array]:
      foo.c[...] += 1
      return foo.c[...]

    foo = Foo()
    cs = loop(foo)
    self.assertEqual(foo.c[...], 5)
    np.testing.assert_allclose(cs, jnp.arange(1, 6))

  def test_out_axes(self):
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})

    class MLP(nnx.Module):
      @nnx.split_rngs(splits=5, graph=True, graph_updates=True)
      @nnx.vmap(in_axes=(state_axes, state_axes), axis_size=5, graph=True, graph_updates=True)
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.node = nnx.BatchStat(jnp.ones((2,)))

      @nnx.scan(in_axes=(state_axes, nnx.Carry), out_axes=(nnx.Carry, 1, 2), graph=True, graph_updates=True)
      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = nnx.gelu(x)
        return x, x, x

    module = MLP(rngs=nnx.Rngs(0))

    assert module.linear.kernel.shape == (5, 3, 3)
    assert module.linear.bias.shape == (5, 3)
    assert module.node.shape == (2,)

    x = jnp.ones((1, 3))
    c, y1, y2 = module(x)

    assert c.shape == (1, 3)
    assert y1.shape == (1, 5, 3)
    assert y2.shape == (1, 3, 5)

  @parameterized.parameters(True, False)
  def test_out_axes_functional(self, graph_mode):
    class MLP(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.node = nnx.BatchStat(jnp.ones((2,)))

      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = nnx.gelu(x)
        return x, x, x

    @nnx.split_rngs(splits=5, graph=graph_mode, graph_updates=False)
    @nnx.vmap(in_axes=0, axis_size=5, graph=graph_mode, graph_updates=False)
    def create(rngs):
      return MLP(rngs=rngs)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 1, 2), graph=graph_mode, graph_updates=False)
    def forward(module, x):
      return module(x)

    module = create(nnx.Rngs(0))

    x = jnp.ones((1, 3))
    c, y1, y2 = forward(module, x)

    assert c.shape == (1, 3)
    assert y1.shape == (1, 5, 3)
    assert y2.shape == (1, 3, 5)

  def test_in_axes_simple(self):
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})

    class MLP(nnx.Module):
      @nnx.vmap(in_axes=(state_axes, 0), graph=True, graph_updates=True)
      def __init__(self, key: jax.Array):
        rngs = nnx.Rngs(key)
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      @nnx.scan(in_axes=(state_axes, nnx.Carry), out_axes=nnx.Carry, graph=True, graph_updates=True)
      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = nnx.gelu(x)
        return x

    key = jax.random.split(jax.random.key(0), 5)
    module = MLP(key=key)

    x = jnp.ones((1, 3))
    y = module(x)

    assert y.shape == (1, 3)

  @parameterized.parameters(True, False)
  def test_in_axes_simple_functional(self, graph_mode):
    class MLP(nnx.Module):
      def __init__(self, key: jax.Array):
        rngs = nnx.Rngs(key)
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = nnx.gelu(x)
        return x

    @nnx.vmap(in_axes=0, graph=graph_mode, graph_updates=False)
    def create(key):
      return MLP(key=key)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, graph=graph_mode, graph_updates=False)
    def forward(module, x):
      return module(x)

    key = jax.random.split(jax.random.key(0), 5)
    module = create(key)

    x = jnp.ones((1, 3))
    y = forward(module, x)

    assert y.shape == (1, 3)

  def test_in_axes(self):
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState, nnx.Intermediate): 0, ...: None})

    class MLP(nnx.Module):
      @nnx.split_rngs(splits=5, graph=True, graph_updates=True)
      @nnx.vmap(in_axes=(state_axes, state_axes), graph=True, graph_updates=True)
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      @nnx.scan(in_axes=(state_axes, nnx.Carry, 0), graph=True, graph_updates=True)
      def __call__(
        self, x: jax.Array, a: jax.Array
      ) -> tp.Tuple[jax.Array, None]:
        assert x.shape == a.shape
        x = x + a
        x = self.linear(x)
        x = nnx.gelu(x)
        self.sow(nnx.Intermediate, "data", x)
        return x, None

    module = MLP(rngs=nnx.Rngs(0))

    assert module.linear.kernel.shape == (5, 3, 3)
    assert module.linear.bias.shape == (5, 3)
    assert module.node.shape == (2,)

    x = jnp.ones((1, 3))
    a = jnp.ones((5, 1, 3))
    (y, out), intermediates = nnx.capture(module, nnx.Intermediate)(x, a)

    assert y.shape == (1, 3)
    assert out is None

    assert intermediates['data'][0].shape == (5, 1, 3)

  @parameterized.parameters(True, False)
  def test_in_axes_functional(self, graph_mode):
    class MLP(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      def __call__(self, x: jax.Array, a: jax.Array) -> tp.Tuple[jax.Array, None]:
        assert x.shape == a.shape
        x = x + a
        x = self.linear(x)
        x = nnx.gelu(x)
        self.sow(nnx.Intermediate, "data", x)
        return x, None

    @nnx.split_rngs(splits=5, graph=graph_mode, graph_updates=False)
    @nnx.vmap(in_axes=0, axis_size=5, graph=graph_mode, graph_updates=False)
    def create(rngs):
      return MLP(rngs=rngs)

    @nnx.scan(in_axes=(0, nnx.Carry, 0), graph=graph_mode, graph_updates=False)
    def forward(module, x, a):
      return module(x, a)

    module = create(nnx.Rngs(0))

    x = jnp.ones((1, 3))
    a = jnp.ones((5, 1, 3))
    (y, out), intermediates = nnx.capture(forward, nnx.Intermediate)(module, x, a)

    assert y.shape == (1, 3)
    assert out is None
    assert intermediates['data'][0].shape == (5, 1, 3)

  def test_in_axes_broadcast(self):
    test = self
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})

    class MLP(nnx.Module):
      @nnx.split_rngs(splits=5, graph=True, graph_updates=True)
      @nnx.vmap(in_axes=(state_axes, state_axes), graph=True, graph_updates=True)
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.node = nnx.BatchStat(jnp.ones((2,)))

      @nnx.scan(in_axes=(state_axes, nnx.Carry, 0, None), graph=True, graph_updates=True)
      def __call__(
        self, x: jax.Array, a: jax.Array, b: jax.Array
      ) -> tp.Tuple[jax.Array, None]:
        test.assertEqual(x.shape, a.shape)
        test.assertEqual(x.shape, b.shape)
        x = x + a + b
        x = self.linear(x)
        x = nnx.gelu(x)
        return x, None

    module = MLP(rngs=nnx.Rngs(0))

    self.assertEqual(module.linear.kernel.shape, (5, 3, 3))
    self.assertEqual(module.linear.bias.shape, (5, 3))
    self.assertEqual(module.node.shape, (2,))

    x = jnp.ones((1, 3))
    a = jnp.ones((5, 1, 3))
    b = jnp.ones((1, 3))
    y, out = module(x, a, b)

    self.assertEqual(y.shape, (1, 3))
    self.assertIsNone(out)

  @parameterized.parameters(True, False)
  def test_in_axes_broadcast_functional(self, graph_mode):
    test = self

    class MLP(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.node = nnx.BatchStat(jnp.ones((2,)))

      def __call__(self, x: jax.Array, a: jax.Array, b: jax.Array) -> tp.Tuple[jax.Array, None]:
        test.assertEqual(x.shape, a.shape)
        test.assertEqual(x.shape, b.shape)
        x = x + a + b
        x = self.linear(x)
        x = nnx.gelu(x)
        return x, None

    @nnx.split_rngs(splits=5, graph=graph_mode, graph_updates=False)
    @nnx.vmap(in_axes=0, axis_size=5, graph=graph_mode, graph_updates=False)
    def create(rngs):
      return MLP(rngs=rngs)

    @nnx.scan(in_axes=(0, nnx.Carry, 0, None), graph=graph_mode, graph_updates=False)
    def forward(module, x, a, b):
      return module(x, a, b)

    module = create(nnx.Rngs(0))

    x = jnp.ones((1, 3))
    a = jnp.ones((5, 1, 3))
    b = jnp.ones((1, 3))
    y, out = forward(module, x, a, b)

    self.assertEqual(y.shape, (1, 3))
    self.assertIsNone(out)

  def test_complex(self):
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})

    class MLP(nnx.Module):
      @nnx.split_rngs(splits=5, graph=True, graph_updates=True)
      @nnx.vmap(in_axes=(state_axes, state_axes), graph=True, graph_updates=True)
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      @nnx.scan(in_axes=(state_axes, nnx.Carry), graph=True, graph_updates=True)
      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    module = MLP(rngs=nnx.Rngs(0))
    module.set_attributes(deterministic=False, use_running_average=False)

    assert module.linear.kernel.shape == (5, 3, 3)
    assert module.linear.bias.shape == (5, 3)
    assert module.node.shape == (2,)

    x = jnp.ones((1, 3))
    y, _ = module(x)

    assert y.shape == (1, 3)

  @parameterized.parameters(True, False)
  def test_complex_functional(self, graph_mode):
    class MLP(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.BatchStat(jnp.ones((2,)))

      def __call__(self, x: jax.Array) -> tp.Tuple[jax.Array, None]:
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    @nnx.split_rngs(splits=5, graph=graph_mode, graph_updates=False)
    @nnx.vmap(in_axes=0, axis_size=5, graph=graph_mode, graph_updates=False)
    def create(rngs):
      m = MLP(rngs=rngs)
      m.set_attributes(deterministic=False, use_running_average=False)
      return m

    @nnx.scan(in_axes=(0, nnx.Carry), graph=graph_mode, graph_updates=False)
    def forward(module, x):
      return module(x)

    module = create(nnx.Rngs(0))

    x = jnp.ones((1, 3))
    y, _ = forward(module, x)

    assert y.shape == (1, 3)

  def test_complex_view(self):
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})

    class MLP(nnx.Module):
      @nnx.split_rngs(splits=5, graph=True, graph_updates=True)
      @nnx.vmap(in_axes=(state_axes, state_axes), graph=True, graph_updates=True)
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      @nnx.scan(in_axes=(state_axes, nnx.Carry), graph=True, graph_updates=True)
      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    module = MLP(rngs=nnx.Rngs(0))
    new_module = nnx.view(module, deterministic=False, use_running_average=False)

    assert new_module.linear.kernel.shape == (5, 3, 3)
    assert new_module.linear.bias.shape == (5, 3)
    assert new_module.node.shape == (2,)

    x = jnp.ones((1, 3))
    y, _ = new_module(x)

    assert y.shape == (1, 3)

  @parameterized.parameters(True, False)
  def test_complex_view_functional(self, graph_mode):
    class MLP(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      def __call__(self, x: jax.Array) -> tp.Tuple[jax.Array, None]:
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    @nnx.split_rngs(splits=5, graph=graph_mode, graph_updates=False)
    @nnx.vmap(in_axes=0, axis_size=5, graph=graph_mode, graph_updates=False)
    def create(rngs):
      return MLP(rngs=rngs)

    @nnx.scan(in_axes=(0, nnx.Carry), graph=graph_mode, graph_updates=False)
    def forward(module, x):
      return module(x)

    module = create(nnx.Rngs(0))
    new_module = nnx.view(module, deterministic=False, use_running_average=False)

    x = jnp.ones((1, 3))
    y, _ = forward(new_module, x)

    assert y.shape == (1, 3)

  def test_complex_broadcast_dropout(self):
    state_axes = nnx.StateAxes({(nnx.Param, 'params'): 0, ...: None})

    class MLP(nnx.Module):
      @nnx.split_rngs(splits=5, only='params', graph=True, graph_updates=True)
      @nnx.vmap(in_axes=(state_axes, state_axes), graph=True, graph_updates=True)
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      @nnx.split_rngs(splits=5, only='params', graph=True, graph_updates=True)
      @nnx.scan(in_axes=(state_axes, nnx.Carry), graph=True, graph_updates=True)
      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    module = MLP(rngs=nnx.Rngs(params=0, dropout=1))
    module.set_attributes(deterministic=False, use_running_average=False)

    assert module.linear.kernel.shape == (5, 3, 3)
    assert module.linear.bias.shape == (5, 3)
    assert module.node.shape == (2,)

    x = jnp.ones((1, 3))
    y, _ = module(x)

    assert y.shape == (1, 3)

  @parameterized.parameters((False,))
  def test_complex_broadcast_dropout_functional(self, graph_mode):

    class Block(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      def __call__(self, x: jax.Array) -> tp.Tuple[jax.Array, None]:
        x = nnx.gelu(self.dropout(self.bn(self.linear(x))))
        return x, None

    rngs = nnx.Rngs(params=0, dropout=1)
    dummy_module = Block(rngs)
    (module_axes, rngs_axes) = nnx.prefix((dummy_module, rngs), {(nnx.Param, 'params', 'dropout'): 0, ...: None}, graph=graph_mode)

    @nnx.with_rngs(split={'params': 5}, broadcast={'dropout': 5}, graph=graph_mode, graph_updates=False)
    @nnx.vmap(in_axes=(rngs_axes,), out_axes=module_axes, axis_size=5, graph=graph_mode, graph_updates=False)
    def create(rngs: nnx.Rngs):
      return Block(rngs=rngs)

    module = create(rngs)

    @nnx.scan(in_axes=(module_axes, nnx.Carry), graph=graph_mode, graph_updates=False)
    def forward(module, x):
      module = nnx.with_attributes(module, deterministic=False, use_running_average=False)
      return module(x)

    assert module.linear.kernel.shape == (5, 3, 3)
    assert module.linear.bias.shape == (5, 3)
    assert module.node.shape == (2,)

    x = jnp.ones((1, 3))
    y, _ = forward(module, x)

    assert y.shape == (1, 3)

  def test_complex_broadcast_dropout_view(self):
    state_axes = nnx.StateAxes({(nnx.Param, 'params'): 0, ...: None})

    class MLP(nnx.Module):
      @nnx.split_rngs(splits=5, only='params', graph=True, graph_updates=True)
      @nnx.vmap(in_axes=(state_axes, state_axes), graph=True, graph_updates=True)
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      @nnx.split_rngs(splits=5, only='params', graph=True, graph_updates=True)
      @nnx.scan(in_axes=(state_axes, nnx.Carry), graph=True, graph_updates=True)
      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    module = MLP(rngs=nnx.Rngs(params=0, dropout=1))
    new_module = nnx.view(module, deterministic=False, use_running_average=False)

    assert new_module.linear.kernel.shape == (5, 3, 3)
    assert new_module.linear.bias.shape == (5, 3)
    assert new_module.node.shape == (2,)

    x = jnp.ones((1, 3))
    y, _ = new_module(x)

    assert y.shape == (1, 3)

  def test_complex_decorator(self):
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})

    class Block(nnx.Module):
      @nnx.split_rngs(splits=5, graph=True, graph_updates=True)
      @nnx.vmap(in_axes=(state_axes, state_axes), axis_size=5, graph=True, graph_updates=True)
      def __init__(self, rngs: nnx.Rngs):
        self.d = 3
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      @nnx.scan(in_axes=(state_axes, nnx.Carry), graph=True, graph_updates=True)
      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    module = Block(rngs=nnx.Rngs(0))
    module.set_attributes(deterministic=False, use_running_average=False)

    assert module.d == 3
    assert module.linear.kernel.shape == (5, 3, 3)
    assert module.linear.bias.shape == (5, 3)
    assert module.node.shape == (2,)

    x = jnp.ones((1, 3))
    y, out = module(x)

    assert y.shape == (1, 3)
    assert out is None

  @parameterized.parameters(True, False)
  def test_complex_decorator_functional(self, graph_mode):
    class Block(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.d = 3
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      def __call__(self, x: jax.Array) -> tp.Tuple[jax.Array, None]:
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    @nnx.split_rngs(splits=5, graph=graph_mode, graph_updates=False)
    @nnx.vmap(in_axes=0, axis_size=5, graph=graph_mode, graph_updates=False)
    def create(rngs):
      m = Block(rngs=rngs)
      m.set_attributes(deterministic=False, use_running_average=False)
      return m

    @nnx.scan(in_axes=(0, nnx.Carry), graph=graph_mode, graph_updates=False)
    def forward(module, x):
      return module(x)

    module = create(nnx.Rngs(0))

    x = jnp.ones((1, 3))
    y, _ = forward(module, x)

    assert y.shape == (1, 3)

  @parameterized.parameters(True, False)
  def test_complex_broadcast_dropout_view_functional(self, graph_mode):
    class Block(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.d = 3
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      def __call__(self, x: jax.Array) -> tp.Tuple[jax.Array, None]:
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    @nnx.split_rngs(splits=5, graph=graph_mode, graph_updates=False)
    @nnx.vmap(in_axes=0, axis_size=5, graph=graph_mode, graph_updates=False)
    def create(rngs):
      m = Block(rngs=rngs)
      m.set_attributes(deterministic=False, use_running_average=False)
      return m

    @nnx.scan(in_axes=(0, nnx.Carry), graph=graph_mode, graph_updates=False)
    def forward(module, x):
      return module(x)

    module = create(nnx.Rngs(0))

    x = jnp.ones((1, 3))
    y, _ = forward(module, x)

    assert y.shape == (1, 3)

  def test_complex_decorator_view(self):
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})

    class Block(nnx.Module):
      @nnx.split_rngs(splits=5, graph=True, graph_updates=True)
      @nnx.vmap(in_axes=(state_axes, state_axes), axis_size=5, graph=True, graph_updates=True)
      def __init__(self, rngs: nnx.Rngs):
        self.d = 3
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      @nnx.scan(in_axes=(state_axes, nnx.Carry), graph=True, graph_updates=True)
      def __call__(self, x: jax.Array):
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    module = Block(rngs=nnx.Rngs(0))
    new_module = nnx.view(module, deterministic=False, use_running_average=False)

    assert new_module.d == 3
    assert new_module.linear.kernel.shape == (5, 3, 3)
    assert new_module.linear.bias.shape == (5, 3)
    assert new_module.node.shape == (2,)

    x = jnp.ones((1, 3))
    y, out = new_module(x)

    assert y.shape == (1, 3)
    assert out is None

  @parameterized.parameters(True, False)
  def test_complex_decorator_view_functional(self, graph_mode):
    class Block(nnx.Module):
      def __init__(self, rngs: nnx.Rngs):
        self.d = 3
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.node = nnx.Variable(jnp.ones((2,)))

      def __call__(self, x: jax.Array) -> tp.Tuple[jax.Array, None]:
        x = self.linear(x)
        x = self.bn(x)
        x = self.dropout(x)
        x = nnx.gelu(x)
        return x, None

    @nnx.split_rngs(splits=5, graph=graph_mode, graph_updates=False)
    @nnx.vmap(in_axes=0, axis_size=5, graph=graph_mode, graph_updates=False)
    def create(rngs):
      return Block(rngs=rngs)

    @nnx.scan(in_axes=(0, nnx.Carry), graph=graph_mode, graph_updates=False)
    def forward(module, x):
      return module(x)

    module = create(nnx.Rngs(0))
    new_module = nnx.view(module, deterministic=False, use_running_average=False)

    assert new_module.d == 3

    x = jnp.ones((1, 3))
    y, _ = forward(new_module, x)

    assert y.shape == (1, 3)

  def test_scan_with_sharding(self):
    test = self
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})
    transform_metadata = {nnx.PARTITION_NAME: 'layers'}

    class MLP(nnx.Module):

      @nnx.split_rngs(splits=5, graph=True, graph_updates=True)
      @nnx.vmap(
          in_axes=(state_axes, state_axes),
          transform_metadata=transform_metadata,
          graph=True,
          graph_updates=True,
      )
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(
          3,
          3,
          kernel_init=nnx.with_metadata(
            nnx.initializers.lecun_normal(), out_sharding=('din', 'dout')
          ),
          bias_init=nnx.with_metadata(
            nnx.initializers.zeros_init(), out_sharding=('dout',)
          ),
          rngs=rngs,
        )

      @nnx.scan(
          in_axes=(state_axes, nnx.Carry),
          transform_metadata=transform_metadata,
          graph=True,
          graph_updates=True,
      )
      def __call__(self, x: jax.Array):
        x = self.linear(x)
        # test sharding layer axes is not present inside scan
        test.assertEqual(self.linear.kernel.shape, (3, 3))
        test.assertEqual(self.linear.kernel.out_sharding, ('din', 'dout'))
        test.assertEqual(self.linear.bias.shape, (3,))
        test.assertEqual(self.linear.bias.out_sharding, ('dout',))
        return x, None

    mesh = jax.make_mesh((1, 1, 1), ('layers', 'din', 'dout'), axis_types=(jax.sharding.AxisType.Auto,) * len(('layers', 'din', 'dout')))
    with jax.set_mesh(mesh):
      m = MLP(rngs=nnx.Rngs(0))

    # test sharding layers axes is set
    self.assertEqual(m.linear.kernel.shape, (5, 3, 3))
    self.assertEqual(m.linear.kernel.out_sharding, ('layers', 'din', 'dout'))
    self.assertEqual(m.linear.bias.shape, (5, 3))
    self.assertEqual(m.linear.bias.out_sharding, ('layers', 'dout'))

    x = jnp.ones((1, 3))
    with jax.set_mesh(mesh):
      y, out = m(x)

    # test sharding axes is preserved
    self.assertEqual(m.linear.kernel.shape, (5, 3, 3))
    self.assertEqual(m.linear.kernel.out_sharding, ('layers', 'din', 'dout'))
    self.assertEqual(m.linear.bias.shape, (5, 3))
    self.assertEqual(m.linear.bias.out_sharding, ('layers', 'dout'))

  @parameterized.parameters(True, False)
  def test_scan_with_sharding_functional(self, graph):
    test = self

    class MLP(nnx.Module):

      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(
            3,
            3,
            kernel_init=nnx.with_metadata(
                nnx.initializers.lecun_normal(), out_sharding=('din', 'dout')
            ),
            bias_init=nnx.with_metadata(
                nnx.initializers.zeros_init(), out_sharding=('dout',)
            ),
            rngs=rngs,
        )

      def __call__(self, x: jax.Array):
        x = self.linear(x)
        return x

    mesh = jax.make_mesh(
        (1, 1, 1),
        ('layers', 'din', 'dout'),
        axis_types=(jax.sharding.AxisType.Auto,) * 3,
    )

    @nnx.vmap(
        in_axes=0,
        out_axes=0,
        graph=graph,
        graph_updates=False,
    )
    @nnx.transform_metadata(
        in_axes=0,
        out_axes=0,
        partition='layers',
        graph=graph,
    )
    def init_fn(rngs):
      return MLP(rngs)

    with jax.set_mesh(mesh):
      m = init_fn(nnx.Rngs(0).split(5))

    # verify shapes outside
    self.assertEqual(m.linear.kernel.shape, (5, 3, 3))
    self.assertEqual(m.linear.kernel.out_sharding, ('layers', 'din', 'dout'))
    self.assertEqual(m.linear.bias.shape, (5, 3))
    self.assertEqual(m.linear.bias.out_sharding, ('layers', 'dout'))

    x = jnp.ones((1, 3))

    @nnx.scan(
        in_axes=(0, nnx.Carry),
        out_axes=nnx.Carry,
        graph=graph,
        graph_updates=False,
    )
    @nnx.transform_metadata(
        in_axes=(0, nnx.Carry),
        out_axes=nnx.Carry,
        partition='layers',
        graph=graph,
    )
    def call_fn(m, x):
      y = m(x)
      # test sharding layer axes is not present inside scan
      test.assertEqual(m.linear.kernel.shape, (3, 3))
      test.assertEqual(m.linear.kernel.out_sharding, ('din', 'dout'))
      test.assertEqual(m.linear.bias.shape, (3,))
      test.assertEqual(m.linear.bias.out_sharding, ('dout',))
      return y

    with jax.set_mesh(mesh):
      y = call_fn(m, x)

    # verify shapes after call
    self.assertEqual(m.linear.kernel.shape, (5, 3, 3))
    self.assertEqual(m.linear.kernel.out_sharding, ('layers', 'din', 'dout'))
    self.assertEqual(m.linear.bias.shape, (5, 3))
    self.assertEqual(m.linear.bias.out_sharding, ('layers', 'dout'))

  @parameterized.parameters(True, False)
  def test_cache_tracing_simple(self, graph_updates):
    n = 0
    x = jnp.arange(5)
    count = jnp.array(0)

    @nnx.scan(graph_updates=graph_updates)
    def f(count, x):
      nonlocal n
      n += 1
      return count + 1, x**2

    count, y = f(count, x)
    self.assertEqual(n, 1)
    self.assertEqual(count, 5)
    np.testing.assert_allclose(y, x**2)

    count, y = f(count, x)
    self.assertEqual(n, 1)
    self.assertEqual(count, 10)

  @parameterized.parameters(True, False)
  def test_cache_tracing_object(self, graph_updates):
    n = 0
    x = jnp.arange(5)
    count = jnp.array(0)

    class Foo(nnx.Pytree):
      def __init__(self, rngs: nnx.Rngs):
        self.x = nnx.Param(rngs.normal((3,)))

    @nnx.split_rngs(splits=5)
    @nnx.vmap(graph_updates=graph_updates)
    def create_foo(rngs: nnx.Rngs):
      return Foo(rngs)

    foo = create_foo(nnx.Rngs(0))
    self.assertEqual(foo.x.shape, (5, 3))

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), graph_updates=graph_updates)
    def f(count, x, foo):
      nonlocal n
      n += 1
      self.assertEqual(foo.x.shape, (3,))
      return count + 1, x**2

    count, y = f(count, x, foo)
    self.assertEqual(n, 1)
    self.assertEqual(count, 5)
    np.testing.assert_allclose(y, x**2)

    count, y = f(count, x, foo)
    self.assertEqual(n, 1)
    self.assertEqual(count, 10)

  def test_scan_broadcast_keys(self):
    params_key = jax.random.split(jax.random.key(0), 3)
    rngs = nnx.Rngs(params=params_key, dropout=1)
    state_axes = nnx.StateAxes({'params': 0, ...: None})

    @nnx.scan(
        in_axes=(nnx.Carry, state_axes),
        length=3,
        graph=True,
        graph_updates=True,
    )
    def f(_, rngs: nnx.Rngs):
      param_key = rngs.params()
      dropout_key = rngs.dropout()
      return (), (param_key, dropout_key)

    _, (param_keys, dropout_keys) = f((), rngs)

    assert jnp.not_equal(param_keys[0], param_keys[1])
    assert jnp.not_equal(param_keys[1], param_keys[2])
    assert jnp.equal(dropout_keys[0], dropout_keys[1])
    assert jnp.equal(dropout_keys[1], dropout_keys[2])

  @parameterized.parameters(True, False)
  def test_scan_broadcast_keys_functional(self, graph):
    rngs = nnx.Rngs(params=0, dropout=1).split({'params': 3}).broadcast({'dropout': 3})
    rngs_axes = nnx.prefix(rngs, {...: 0}, graph=graph)

    @nnx.scan(
        in_axes=(rngs_axes,), out_axes=0, graph=graph, graph_updates=False
    )
    def f(rngs):
      param_key = rngs.params()
      dropout_key = rngs.dropout()
      return param_key, dropout_key

    param_keys, dropout_keys = f(rngs)

    assert jnp.not_equal(param_keys[0], param_keys[1])
    assert jnp.not_equal(param_keys[1], param_keys[2])
    assert jnp.equal(dropout_keys[0], dropout_keys[1])
    assert jnp.equal(dropout_keys[1], dropout_keys[2])

  def test_rnn_example(self):
    class RNNCell(nnx.Module):
      def __init__(self, input_size, hidden_size, rngs):
        self.linear = nnx.Linear(
          hidden_size + input_size, hidden_size, rngs=rngs
        )
        self.drop = nnx.Dropout(0.1, deterministic=False, rngs=rngs)
        self.hidden_size = hidden_size

      def __call__(self, carry, x) -> tuple[jax.Array, jax.Array]:
        carry = self.drop(carry)  # recurrent dropout
        x = nnx.relu(self.linear(jnp.concatenate([carry, x], axis=-1)))
        return x, x

      def initial_state(self, batch_size: int):
        return jnp.zeros((batch_size, self.hidden_size))

    cell = RNNCell(20, 20, nnx.Rngs(params=0, dropout=1))

    state_axes = nnx.StateAxes({'dropout': None, ...: nnx.Carry})

    def rnn_forward(cell: RNNCell, x: jax.Array):
      carry = cell.initial_state(x.shape[0])

      @nnx.scan(
          in_axes=(state_axes, nnx.Carry, 1),
          out_axes=(nnx.Carry, 1),
          graph=True,
          graph_updates=True,
      )
      def unroll(cell: RNNCell, carry, x) -> tuple[jax.Array, jax.Array]:
        return cell(carry, x)

      _, y = unroll(cell, carry, x)
      return y

    x = jnp.ones((16, 10, 20))
    y = rnn_forward(cell, x)

  @parameterized.parameters(True, False)
  def test_rnn_example_functional(self, graph):
    class RNNCell(nnx.Module):

      def __init__(self, input_size, hidden_size, rngs):
        self.linear = nnx.Linear(
            hidden_size + input_size, hidden_size, rngs=rngs
        )
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.hidden_size = hidden_size

      def __call__(self, carry, x) -> tuple[jax.Array, jax.Array]:
        carry = self.drop(carry)  # recurrent dropout
        x = nnx.relu(self.linear(jnp.concatenate([carry, x], axis=-1)))
        return x, x

      def initial_state(self, batch_size: int):
        return jnp.zeros((batch_size, self.hidden_size))

    cell = RNNCell(20, 20, nnx.Rngs(params=0, dropout=1))

    cell_axes = nnx.prefix(cell, {'dropout': 0, ...: None}, graph=graph)

    def rnn_forward(cell: RNNCell, x: jax.Array):
      carry = cell.initial_state(x.shape[0])

      @nnx.with_rngs(broadcast={'dropout': 10}, graph=graph, graph_updates=False)
      @nnx.scan(
          in_axes=(cell_axes, nnx.Carry, 1),
          out_axes=(nnx.Carry, 1),
          graph=graph,
          graph_updates=False,
      )
      def unroll(cell: RNNCell, carry, x) -> tuple[jax.Array, jax.Array]:
        return cell(carry, x)

      _, y = unroll(cell, carry, x)
      return y

    x = jnp.ones((16, 10, 20))
    y = rnn_forward(cell, x)

  def test_carry_pytree_sow(self):
    class CarryAsPytree(nnx.Pytree):
      def __init__(self, data: jax.Array):
        self.data = data

    class Model(nnx.Module):
      def __init__(self, num_steps):
        self.fc = nnx.Linear(10, 10, rngs=nnx.Rngs(0))
        self.num_steps = num_steps

      def _step(self, state):
        new_data = state.data + 1
        self.sow(nnx.Intermediate, "data", new_data)
        state.data = new_data
        return state

      def _step2(self, state: tuple[CarryAsPytree, jax.Array, CarryAsPytree]):
        out = self.fc(state[1])

        new_data1 = state[0].data + 1
        new_data2 = state[2].data + 1

        self.sow(nnx.Intermediate, "data1", new_data1)
        self.sow(nnx.Intermediate, "data2", new_data2)

        state[0].data = new_data1
        state[2].data = new_data2
        return (state[0], out, state[2])

      @nnx.jit(static_argnames=("method"), graph=True, graph_updates=True)
      def __call__(self, state, method):
        state_axes = nnx.StateAxes({nnx.Intermediate: 0, ...: nnx.Carry})
        state_final = nnx.scan(
          method,
          in_axes=(state_axes, nnx.Carry),
          out_axes=nnx.Carry,
          length=self.num_steps,
          graph=True,
          graph_updates=True,
        )(self, state)

        return state_final

    num_steps = 5
    model = Model(num_steps=num_steps)
    carry = CarryAsPytree(data=jnp.array(0.0))
    carry_final, intermediates = nnx.capture(model, nnx.Intermediate)(carry, method=Model._step)
    self.assertEqual(carry_final.data, num_steps)
    np.testing.assert_array_equal(
      intermediates['data'][0], 1.0 + jnp.arange(num_steps)
    )

    carry = (
      CarryAsPytree(data=jnp.array(0.0)),
      jnp.ones((10,)),
      CarryAsPytree(data=jnp.array(10.0))
    )

    carry_final, intermediates = nnx.capture(model, nnx.Intermediate)(carry, method=Model._step2)

    self.assertEqual(carry_final[0].data, num_steps)
    self.assertEqual(carry_final[2].data, 10 + num_steps)
    np.testing.assert_array_equal(
      intermediates['data1'][0], 1.0 + jnp.arange(num_steps)
    )
    np.testing.assert_array_equal(
      intermediates['data2'][0], 11.0 + jnp.arange(num_steps)
    )

  @parameterized.parameters(True, False)
  def test_carry_pytree_sow_functional(self, graph):
    class CarryAsPytree(nnx.Pytree):
      def __init__(self, data: jax.Array):
        self.data = data

    class Model(nnx.Module):
      def __init__(self, num_steps):
        self.fc = nnx.Linear(10, 10, rngs=nnx.Rngs(0))
        self.num_steps = num_steps

      def _step(self, state):
        new_data = state.data + 1
        self.sow(nnx.Intermediate, "data", new_data)
        state.data = new_data
        return state

      def _step2(self, state: tuple[CarryAsPytree, jax.Array, CarryAsPytree]):
        out = self.fc(state[1])

        new_data1 = state[0].data + 1
        new_data2 = state[2].data + 1

        self.sow(nnx.Intermediate, "data1", new_data1)
        self.sow(nnx.Intermediate, "data2", new_data2)

        state[0].data = new_data1
        state[2].data = new_data2
        return (state[0], out, state[2])

      @nnx.jit(static_argnames=("method",), graph=graph, graph_updates=False)
      def __call__(self, state, method):
        state_axes = nnx.prefix(
            self, {nnx.Intermediate: 0, ...: None}, graph=graph
        )
        state_final = nnx.scan(
          method,
          in_axes=(state_axes, nnx.Carry),
          out_axes=nnx.Carry,
          length=self.num_steps,
          graph=graph,
          graph_updates=False,
        )(self, state)

        return state_final

    num_steps = 5
    model = Model(num_steps=num_steps)
    carry = CarryAsPytree(data=jnp.array(0.0))
    carry_final, intermediates = nnx.capture(model, nnx.Intermediate)(carry, method=Model._step)
    self.assertEqual(carry_final.data, num_steps)
    np.testing.assert_array_equal(
      intermediates['data'][0], 1.0 + jnp.arange(num_steps)
    )

    carry = (
      CarryAsPytree(data=jnp.array(0.0)),
      jnp.ones((num_steps, 10)),
      CarryAsPytree(data=jnp.array(10.0))
    )

    carry_final, intermediates = nnx.capture(model, nnx.Intermediate)(carry, method=Model._step2)

    self.assertEqual(carry_final[0].data, num_steps)
    self.assertEqual(carry_final[2].data, 10 + num_steps)
    np.testing.assert_array_equal(
      intermediates['data1'][0], 1.0 + jnp.arange(num_steps)
    )
    np.testing.assert_array_equal(
      intermediates['data2'][0], 11.0 + jnp.arange(num_steps)
    )

  def test_broadcast_variable_mutation(self):
    v = nnx.Variable(jnp.array(1))

    @nnx.scan(
      in_axes=(None, nnx.Carry, 0), graph=False, graph_updates=False,
    )
    def fn(v, carry, x):
      v[...] = v[...] + 1
      return carry + x, carry

    carry, ys = fn(v, jnp.array(0), jnp.arange(3))
    # v is broadcast (None axis), mutated each iteration: 1 -> 2 -> 3 -> 4
    self.assertEqual(v[...], 4)
    #   step 0: carry=0, x=0 -> carry=0, y=0
    #   step 1: carry=0, x=1 -> carry=1, y=0
    #   step 2: carry=1, x=2 -> carry=3, y=1
    np.testing.assert_allclose(carry, 3)
    np.testing.assert_allclose(ys, jnp.array([0, 0, 1]))

  def test_broadcast_out_axes_rejected(self):
    with self.assertRaisesRegex(ValueError, 'broadcast'):
      @nnx.scan(
        in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, None),
        graph=False, graph_updates=False,
      )
      def fn(carry, x):
        return carry + x, jnp.zeros(3)

      fn(jnp.array(0.0), jnp.arange(3.0))

  def test_scan_inconsistent_aliasing(self):
    v = nnx.Param(jnp.array(0.0))

    @nnx.scan(
      in_axes=(nnx.Carry, 0),
      out_axes=(nnx.Carry, 0),
      graph=True,
      graph_updates=False,
    )
    def f(carry, x):
      return carry, x[...]

    with self.assertRaisesRegex(ValueError, 'Inconsistent aliasing'):
      f(v, v)

  def test_scan_input_output_aliasing(self):
    v = nnx.Param(jnp.arange(5))

    @nnx.scan(in_axes=0, out_axes=0, graph=True, graph_updates=False)
    def f(carry):
      return carry

    with self.assertRaisesRegex(ValueError, 'does not support Variable aliasing'):
      f(v)

  def test_scan_carry_and_scan(self):
    def cumsum(carry, x):
      carry = carry + x
      return carry, carry

    final_carry, ys = nnx.scan(
        cumsum,
        in_axes=(nnx.Carry, 0),
        out_axes=(nnx.Carry, 0),
        graph=False,
    )(jnp.array(0.0), jnp.arange(5.0))
    np.testing.assert_allclose(final_carry, 10.0)
    np.testing.assert_allclose(ys, jnp.array([0., 1., 3., 6., 10.]))

  def test_scan_pytree_carry(self):
    def dict_scan(carry, x):
      carry = {'a': carry['a'] + x['a'], 'b': carry['b'] + x['b']}
      return carry, carry

    xs = {'a': jnp.arange(3.0), 'b': jnp.ones(3)}
    init = {'a': jnp.array(0.0), 'b': jnp.array(0.0)}
    final_carry, _ = nnx.scan(
        dict_scan,
        in_axes=(nnx.Carry, 0),
        out_axes=(nnx.Carry, 0),
        graph=False,
    )(init, xs)
    np.testing.assert_allclose(final_carry['a'], 3.0)
    np.testing.assert_allclose(final_carry['b'], 3.0)

  def test_scan_reverse(self):
    def cumsum(carry, x):
      carry = carry + x
      return carry, carry

    final_carry, _ = nnx.scan(
        cumsum,
        in_axes=(nnx.Carry, 0),
        out_axes=(nnx.Carry, 0),
        reverse=True,
        graph=False,
    )(jnp.array(0.0), jnp.arange(5.0))
    np.testing.assert_allclose(final_carry, 10.0)

  def test_scan_axis_1(self):
    def cumsum(carry, x):
      carry = carry + x
      return carry, carry

    x = jnp.arange(10.0).reshape((2, 5))
    final_carry, ys = nnx.scan(
        cumsum,
        in_axes=(nnx.Carry, 1),
        out_axes=(nnx.Carry, 1),
        graph=False,
    )(jnp.zeros(2), x)
    np.testing.assert_allclose(final_carry, jnp.array([10.0, 35.0]))
    expected_ys = jnp.array([
        [0., 1., 3., 6., 10.],
        [5., 11., 18., 26., 35.]
    ])
    np.testing.assert_allclose(ys, expected_ys)

  def test_scan_axis_negative_1(self):
    def cumsum(carry, x):
      carry = carry + x
      return carry, carry

    x = jnp.arange(10.0).reshape((2, 5))
    final_carry, ys = nnx.scan(
        cumsum,
        in_axes=(nnx.Carry, -1),
        out_axes=(nnx.Carry, -1),
        graph=False,
    )(jnp.zeros(2), x)
    np.testing.assert_allclose(final_carry, jnp.array([10.0, 35.0]))
    expected_ys = jnp.array([
        [0., 1., 3., 6., 10.],
        [5., 11., 18., 26., 35.]
    ])
    np.testing.assert_allclose(ys, expected_ys)

  def test_scan_different_in_out_axes(self):
    def cumsum(carry, x):
      carry = carry + x
      return carry, carry

    x = jnp.arange(10.0).reshape((2, 5))
    final_carry, ys = nnx.scan(
        cumsum,
        in_axes=(nnx.Carry, 1),
        out_axes=(nnx.Carry, 0),
        graph=False,
    )(jnp.zeros(2), x)
    np.testing.assert_allclose(final_carry, jnp.array([10.0, 35.0]))
    expected_ys = jnp.array([
        [0., 5.],
        [1., 11.],
        [3., 18.],
        [6., 26.],
        [10., 35.]
    ])
    np.testing.assert_allclose(ys, expected_ys)


class TestRemat(parameterized.TestCase):
  def test_remat_with_scan_decorator(self):
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})

    class ScanLinear(nnx.Module):

      @nnx.split_rngs(splits=5, graph=True, graph_updates=True)
      @nnx.vmap(
          in_axes=(state_axes, state_axes),
          axis_size=5,
          graph=True,
          graph_updates=True,
      )
      def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)

      @nnx.scan(
          in_axes=(state_axes, nnx.Carry),
          out_axes=nnx.Carry,
          graph=True,
          graph_updates=True,
      )
      @nnx.remat(graph=True, graph_updates=True)
      def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x)

    m = ScanLinear(nnx.Rngs(0))

    assert m.linear.kernel.shape == (5, 3, 3)
    assert m.linear.bias.shape == (5, 3)

    y = m(jnp.ones((1, 3)))
    assert y.shape == (1, 3)

  @parameterized.parameters(True, False)
  def test_remat_with_scan_decorator_functional(self, graph):
    state_axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})

    class ScanLinear(nnx.Module):

      def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=5, graph=graph, graph_updates=False)
        @nnx.vmap(in_axes=0, axis_size=5, graph=graph, graph_updates=False)
        def create(rngs):
          return nnx.Linear(3, 3, rngs=rngs)

        self.linear = create(rngs)

      def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(
            in_axes=(0, nnx.Carry),
            out_axes=nnx.Carry,
            graph=graph,
            graph_updates=False,
        )
        @nnx.remat(graph=graph, graph_updates=False)
        def forward(linear, x):
          return linear(x)

        return forward(self.linear, x)

    m = ScanLinear(nnx.Rngs(0))

    assert m.linear.kernel.shape == (5, 3, 3)

    x = jnp.ones((2, 3))
    y = m(x)

    assert y.shape == (2, 3)


class TestBoundMethodTransforms(parameterized.TestCase):
  def test_scan_bound_method_raises(self):
    class M(nnx.Module):
      def __call__(self, x: jax.Array):
        return x + 1
    m = M()
    with self.assertRaisesRegex(ValueError, 'bound methods'):
      _ = nnx.scan(m.__call__, in_axes=(0,), out_axes=0)
