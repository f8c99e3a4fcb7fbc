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

# Vendored from Flax 0.12.12 (https://github.com/google/flax, tests/linen/summary_test.py; identical in
# 0.12.8), Copyright The Flax Authors, Apache License 2.0.
# Selected: every test method that uses nn.scan (directly), verbatim. Changes: only the selection
# (other test methods, classes left without tests, and the `__main__` block dropped).
# tests/flax/test_flax_linen_upstream.py runs these with jaxmem.flax.linen.scan in place of nn.scan.
# Selected tests:
#   SummaryTest.test_lifted_transform
#   SummaryTest.test_lifted_transform_no_rename
# ruff: noqa
# fmt: off

import enum

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from jax import random

from flax import linen as nn
from flax import struct
from flax.core.scope import Array
from flax.linen import summary

# Parse absl flags test_srcdir and test_tmpdir.
jax.config.parse_flags_with_absl()

CONSOLE_TEST_KWARGS = dict(force_terminal=False, no_color=True, width=10_000)


def _get_shapes(pytree):
  return jax.tree_util.tree_map(
    lambda x: x.shape if hasattr(x, 'shape') else x, pytree
  )


def _get_obj_repr_value(x):
  if isinstance(x, summary._ObjectRepresentation):
    return x.obj
  return x


class ConvBlock(nn.Module):
  features: int
  kernel_size: list[int]
  test_sow: bool

  def setup(self) -> None:
    self.conv = nn.Conv(self.features, self.kernel_size)
    self.bn = nn.BatchNorm()
    self.dropout = nn.Dropout(0.5)

  def block_method(self, x: Array, training: bool) -> Array:
    x = self.conv(x)

    if self.test_sow:
      self.sow('intermediates', 'INTERM', x)

    x = self.bn(x, use_running_average=not training)
    x = self.dropout(x, deterministic=not training)
    x = nn.relu(x)
    return x

  def __call__(self, x: Array, training: bool) -> Array:
    x = self.conv(x)

    if self.test_sow:
      self.sow('intermediates', 'INTERM', x)

    x = self.bn(x, use_running_average=not training)
    x = self.dropout(x, deterministic=not training)
    x = nn.relu(x)
    return x


class CNN(nn.Module):
  test_sow: bool

  def setup(self) -> None:
    self.block1 = ConvBlock(32, [3, 3], test_sow=self.test_sow)
    self.block2 = ConvBlock(64, [3, 3], test_sow=self.test_sow)
    self.dense = nn.Dense(10)

  def cnn_method(self, x: Array, training: bool) -> Array:
    x = self.block1.block_method(x, training=training)
    x = self.block2.block_method(x, training=training)
    x = x.mean(axis=(1, 2))

    if self.test_sow:
      self.sow('intermediates', 'INTERM', x)

    x = self.dense(x)

    return x, dict(a=x, b=x + 1.0)

  def __call__(self, x: Array, training: bool) -> Array:
    x = self.block1.block_method(x, training=training)
    x = self.block2.block_method(x, training=training)
    x = x.mean(axis=(1, 2))

    if self.test_sow:
      self.sow('intermediates', 'INTERM', x)

    x = self.dense(x)

    return x, dict(a=x, b=x + 1.0)


class SummaryTest(absltest.TestCase):


  def test_lifted_transform(self):
    class LSTM(nn.Module):
      features: int

      @nn.compact
      def __call__(self, x):
        carry = nn.LSTMCell(self.features).initialize_carry(
          random.key(0), x[:, 0].shape
        )
        ScanLSTM = nn.scan(
          nn.LSTMCell,
          variable_broadcast='params',
          split_rngs={'params': False},
          in_axes=1,
          out_axes=1,
        )
        return ScanLSTM(self.features, name='ScanLSTM')(carry, x)

    lstm = LSTM(features=128)

    with jax.check_tracer_leaks(True):
      module_repr = lstm.tabulate(
        random.key(0),
        x=jnp.ones((32, 128, 64)),
        console_kwargs=CONSOLE_TEST_KWARGS,
        compute_flops=True,
        compute_vjp_flops=True,
      )

    lines = module_repr.splitlines()

    self.assertIn('LSTM', lines[5])
    self.assertIn('ScanLSTM', lines[9])
    self.assertIn('LSTMCell', lines[9])
    self.assertIn('ScanLSTM/ii', lines[13])
    self.assertIn('Dense', lines[13])

  def test_lifted_transform_no_rename(self):
    class LSTM(nn.Module):
      features: int

      @nn.compact
      def __call__(self, x):
        carry = nn.LSTMCell(self.features).initialize_carry(
          random.key(0), x[:, 0].shape
        )
        ScanLSTM = nn.scan(
          nn.LSTMCell,
          variable_broadcast='params',
          split_rngs={'params': False},
          in_axes=1,
          out_axes=1,
        )
        return ScanLSTM(self.features)(carry, x)

    lstm = LSTM(features=128)

    with jax.check_tracer_leaks(True):
      module_repr = lstm.tabulate(
        random.key(0),
        x=jnp.ones((32, 128, 64)),
        console_kwargs=CONSOLE_TEST_KWARGS,
        compute_flops=True,
        compute_vjp_flops=True,
      )

    lines = module_repr.splitlines()

    self.assertIn('LSTM', lines[5])
    self.assertIn('ScanLSTMCell_0', lines[9])
    self.assertIn('LSTMCell', lines[9])
    self.assertIn('ScanLSTMCell_0/ii', lines[13])
    self.assertIn('Dense', lines[13])
