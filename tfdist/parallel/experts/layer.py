"""A mixture-of-experts Keras 3 layer with top-k routing and capacity.

`MixtureOfExperts` replaces a Transformer's feed-forward block by E
experts and a router (Shazeer et al. 2017, "Outrageously Large Neural
Networks"): each token goes to the k experts its router scores highest,
so the parameters grow with E while the compute per token stays that of k
experts. Routing follows GShard (Lepikhin et al. 2020, Algorithm 2) for
k = 2 and the Switch Transformer (Fedus et al. 2021) for k = 1; the
auxiliary losses are Switch's load-balancing loss and ST-MoE's router
z-loss (Zoph et al. 2022).

Dispatch and combine are dense tensors, as in GShard and Mesh TensorFlow:
a dispatch mask [groups, group_size, E, C] gathers the tokens into the
experts' inputs [E, groups * C, d_model] with one einsum, and combine
weights of the same shape scatter the experts' outputs back. Built inside
`placement.placement_scope` (expert parallelism, `--expert_parallel`), a
layer holds only its replica's E / E_p experts, and the [E, groups, C,
d_model] expert inputs travel to the replicas holding their experts by
all-to-all (`tfdist.parallel.experts.mode`); otherwise every expert runs
where the layer runs.
"""

import contextlib
from typing import Any, Callable, Dict, Optional, Union

import keras
import tensorflow as tf

from tfdist import errors
from tfdist.runtime import wording
from tfdist.parallel import collectives
from tfdist.parallel.experts import placement as placement_lib
from tfdist.parallel.experts import traffic
from tfdist.runtime import private_api

# Added to the two chosen gates' sum before top-2 renormalization (GShard's
# epsilon); softmax gates are positive, so it matters only on underflow.
_GATE_EPSILON = 1e-9
STATISTICS = ("tokens_per_expert", "dropped_fraction", "load_balancing_loss",
              "router_z_loss")


# C = ceil(k * group tokens * cf / E), GShard's and Switch's rule: pure
# Python beside the plan's traffic formula (`traffic.capacity`).
capacity = traffic.capacity


@keras.saving.register_keras_serializable(package="tfdist")
class FeedForwardExpert(keras.layers.Layer):
  """One expert: Dense(hidden_dim, activation) then Dense(d_model).

  Input [tokens, d_model] (any leading axes), output the same shape, in
  the layer's compute dtype; d_model is read from the input at build.

  Args:
    hidden_dim: width of the hidden layer (> 0).
    activation: of the hidden layer; a Keras activation name or function.
      Defaults to "gelu".
    use_bias: both Dense layers have biases. Defaults to True.
    kernel_initializer: of both kernels. Defaults to "glorot_uniform".
    **kwargs: `keras.layers.Layer` arguments (name, dtype).

  Raises:
    ValueError: `hidden_dim` is not positive.
  """

  def __init__(self, hidden_dim: int, activation: Any = "gelu",
               use_bias: bool = True,
               kernel_initializer: Any = "glorot_uniform", **kwargs):
    super().__init__(**kwargs)
    if int(hidden_dim) < 1:
      raise ValueError(
          f"FeedForwardExpert needs hidden_dim >= 1. Received: hidden_dim="
          f"{hidden_dim}. Pass the width of the expert's hidden layer.")
    self.hidden_dim = int(hidden_dim)
    self.activation = keras.activations.get(activation)
    self.use_bias = bool(use_bias)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.hidden = keras.layers.Dense(
        self.hidden_dim, activation=self.activation, use_bias=self.use_bias,
        kernel_initializer=self.kernel_initializer, dtype=self.dtype_policy,
        name="hidden")
    self.output_dense = None

  def build(self, input_shape):
    self.hidden.build(input_shape)
    self.output_dense = keras.layers.Dense(
        input_shape[-1], use_bias=self.use_bias,
        kernel_initializer=self.kernel_initializer, dtype=self.dtype_policy,
        name="output")
    self.output_dense.build(tuple(input_shape[:-1]) + (self.hidden_dim,))

  def call(self, inputs):
    return self.output_dense(self.hidden(inputs))

  def compute_output_shape(self, input_shape):
    return input_shape

  def get_config(self):
    return {**super().get_config(), "hidden_dim": self.hidden_dim,
            "activation": keras.activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(
                self.kernel_initializer)}


def _first_max(values: tf.Tensor, num_experts: int) -> tf.Tensor:
  """The index of the largest entry of the last axis; of equal entries the
  lowest index (deterministic on every device, unlike `tf.argmax`)."""
  largest = tf.reduce_max(values, axis=-1, keepdims=True)
  index = tf.range(num_experts, dtype=tf.int32)
  return tf.reduce_min(tf.where(values >= largest, index, num_experts),
                       axis=-1)


@keras.saving.register_keras_serializable(package="tfdist")
class MixtureOfExperts(keras.layers.Layer):
  """Top-k mixture of E experts with capacity (GShard, Switch, ST-MoE).

  Sources: Shazeer et al. 2017 (arXiv:1701.06538, the sparsely-gated
  mixture of experts); GShard, Lepikhin et al. 2020 (arXiv:2006.16668,
  Algorithm 2: top-2 gating, capacity, dense dispatch and combine); Switch
  Transformer, Fedus et al. 2021 (arXiv:2101.03961: top-1, capacity
  factor, load-balancing loss); ST-MoE, Zoph et al. 2022
  (arXiv:2202.08906: router z-loss).

  Each token x (a row of d_model features) is scored by the router, a
  bias-free Dense layer computing float32 logits [tokens, E] (float32 even
  under a mixed precision policy, as Switch's "selective precision"):

      probs = softmax(logits)
      k = 1 (Switch):  e1 = argmax(probs),  gate1 = probs[e1]
      k = 2 (GShard):  e2 = argmax(probs without e1),
                       gate_i = probs[e_i] / (probs[e1] + probs[e2])
      y = sum_i gate_i * expert_{e_i}(x)          (over kept slots i)

  Ties go to the lower expert index. Tokens are routed in groups of
  `group_size` consecutive tokens (rows of the flattened input, row-major
  over [batch, seq]; default: all tokens of the call are one group). Each
  expert takes at most C = ceil(k * group_size * capacity_factor / E)
  tokens of a group (`capacity`): first every token's first choice, in
  token order, then the second choices in token order into the slots
  left (GShard). A choice past capacity is dropped: its gate's share of
  the output is zero, and a token that lost all its choices outputs zero
  (the caller's residual connection carries it, as in Switch). The gates
  are renormalized before the capacity check, so a token that keeps only
  its first choice outputs gate1 * expert_{e1}(x).

  Auxiliary losses (float32 scalars, over all tokens of the call), added
  with `add_loss` times their weights (a weight of 0 adds nothing):

      load_balancing_loss = E * sum_e f_e * P_e     (Switch, eq. 4)
          f_e: fraction of tokens whose first choice is e (before capacity)
          P_e: mean over tokens of probs[:, e]
      router_z_loss = mean over tokens of logsumexp(logits)^2  (ST-MoE, eq. 5)

  GShard's random dispatch of the second choice and Switch's router
  jitter noise are not implemented: routing is deterministic.

  Expert parallelism: constructed inside `placement.placement_scope`
  (`tfdist.parallel.experts.mode.build` does it), the layer holds the
  L = E / E_p experts of its replica's slot (`local_expert_<j>`, weights
  sync-on-read with one value per replica) and must be called inside
  `strategy.run` in a `tf.function`: each replica routes its own tokens
  (groups never span replicas), exchanges the expert inputs and outputs
  with its expert group by all-to-all, and averages f_e, P_e and the
  z-loss (sums the kept slots) over every replica, so the losses and
  statistics are one device's on the global batch.

  Routing statistics of the last call are kept as non-trainable float32
  variables (`routing_statistics()`; under a data-parallel strategy each
  replica writes its own copy, and a read outside the replicas gives
  their mean):
  `tokens_per_expert` [E] (kept slots per expert), `dropped_fraction`
  (dropped slots / (k * tokens)), `load_balancing_loss` and
  `router_z_loss` (unweighted).

  Shapes and dtypes: input [batch, seq, d_model] or [tokens, d_model], a
  floating dtype (cast to the layer's compute dtype); output the same
  shape in the compute dtype. Inside: dispatch and combine
  [groups, group_size, E, C] float32 (cast to the compute dtype for the
  einsums), expert inputs and outputs [E, groups * C, d_model].

  Args:
    num_experts: E (>= 1).
    hidden_dim: hidden width of the default experts (`FeedForwardExpert`);
      required unless `expert` is given.
    top_k: experts per token, 1 or 2 (<= E). Defaults to 2.
    capacity_factor: slots per expert over an even share (> 0); 1.0 gives
      k * group_size / E. Defaults to 1.25.
    group_size: tokens per routing group; the tokens of a call must be a
      multiple of it. None: all tokens of the call form one group (C then
      grows with the batch, and so do dispatch and combine, as
      tokens * E * C). Defaults to None.
    activation: of the default experts' hidden layer. Defaults to "gelu".
    expert: None (the default experts), a `keras.layers.Layer` subclass
      (each expert is `expert(**expert_config, name="expert_<i>")`), or a
      function `expert(index) -> keras.layers.Layer`. An expert maps
      [tokens, d_model] to [tokens, d_model]; its output is cast to the
      layer's compute dtype. For `get_config`, a class or
      function must be registered with
      `keras.saving.register_keras_serializable`.
    expert_config: keyword arguments of an `expert` class. Defaults to {}.
    load_balancing_loss_weight: weight of the load-balancing loss (>= 0;
      Switch uses 1e-2). Defaults to 1e-2.
    router_z_loss_weight: weight of the router z-loss (>= 0; ST-MoE uses
      1e-3). Defaults to 1e-3.
    kernel_initializer: of the router and default experts' kernels.
      Defaults to "glorot_uniform".
    **kwargs: `keras.layers.Layer` arguments (name, dtype).

  Raises:
    tfdist.errors.ConfigError: at construction under expert parallelism,
      E not a multiple of E_p; at call, outside a replica function traced
      by `tf.function`.
    ValueError: at construction, an argument out of range (E < 1, top_k
      not 1 or 2 or above E, capacity_factor <= 0 (capacity 0 drops every
      token), a negative loss weight, group_size < 1, neither `hidden_dim`
      nor `expert`; an `expert` function that returns no Layer); at build
      or call, an input that is not
      [batch, seq, d_model] or [tokens, d_model] with a known d_model, or
      whose tokens are not a multiple of `group_size`.

  Example:

      moe = tfdist.MixtureOfExperts(num_experts=4, hidden_dim=64, top_k=2)
      y = moe(tf.random.normal([2, 8, 16]))        # [2, 8, 16]
      moe.routing_statistics()["dropped_fraction"]
  """

  def __init__(self, num_experts: int, hidden_dim: Optional[int] = None, *,
               top_k: int = 2, capacity_factor: float = 1.25,
               group_size: Optional[int] = None, activation: Any = "gelu",
               expert: Union[None, type, Callable[[int], Any]] = None,
               expert_config: Optional[Dict[str, Any]] = None,
               load_balancing_loss_weight: float = 1e-2,
               router_z_loss_weight: float = 1e-3,
               kernel_initializer: Any = "glorot_uniform", **kwargs):
    super().__init__(**kwargs)
    _check_arguments(num_experts=num_experts, hidden_dim=hidden_dim,
                     top_k=top_k, capacity_factor=capacity_factor,
                     group_size=group_size, expert=expert,
                     load_balancing_loss_weight=load_balancing_loss_weight,
                     router_z_loss_weight=router_z_loss_weight)
    self.num_experts = int(num_experts)
    self.hidden_dim = None if hidden_dim is None else int(hidden_dim)
    self.top_k = int(top_k)
    self.capacity_factor = float(capacity_factor)
    self.group_size = None if group_size is None else int(group_size)
    self.activation = keras.activations.get(activation)
    self.expert = expert
    self.expert_config = dict(expert_config or {})
    self.load_balancing_loss_weight = float(load_balancing_loss_weight)
    self.router_z_loss_weight = float(router_z_loss_weight)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.router = keras.layers.Dense(
        self.num_experts, use_bias=False, dtype="float32",
        kernel_initializer=self.kernel_initializer, name="router")
    # Expert parallelism (`placement.placement_scope`): this replica's
    # L = E / E_p experts only, as `local_expert_<j>`.
    self.placement = placement_lib.current()
    if self.placement is not None:
      _check_placement(self.num_experts, self.top_k, self.placement)
    # One attribute per expert (not a list): TensorFlow's checkpoints name
    # each expert's weights by it (`.../expert_3/hidden/kernel`), the same
    # for any E; a list's layers would be missing from the object graph.
    for i in range(self._num_local_experts):
      name = (f"expert_{i}" if self.placement is None else
              f"local_expert_{i}")
      setattr(self, name, self._make_expert(i, name))

  @property
  def _num_local_experts(self) -> int:
    if self.placement is None:
      return self.num_experts
    return self.num_experts // self.placement.expert_parallel

  @property
  def experts(self):
    """The E expert layers, in index order; expert-parallel, this
    replica's L = E / E_p (`local_expert_<j>`: on the replica of slot s,
    expert s * L + j)."""
    if self.placement is not None:
      return [getattr(self, f"local_expert_{j}")
              for j in range(self._num_local_experts)]
    return [getattr(self, f"expert_{i}") for i in range(self.num_experts)]

  def _make_expert(self, index: int, name: str):
    if self.expert is None:
      return FeedForwardExpert(
          self.hidden_dim, activation=self.activation,
          kernel_initializer=self.kernel_initializer,
          dtype=self.dtype_policy, name=name)
    if isinstance(self.expert, type):
      return self.expert(**self.expert_config, name=name)
    made = self.expert(index)
    if not isinstance(made, keras.layers.Layer):
      raise ValueError(
          f"MixtureOfExperts(expert=...) must return a keras.layers.Layer; "
          f"expert({index}) returned {type(made).__name__}. Return the "
          "expert layer.")
    return made

  def _model_dim(self, input_shape) -> int:
    if len(input_shape) not in (2, 3) or input_shape[-1] is None:
      raise ValueError(
          f"MixtureOfExperts (layer {self.name!r}) takes [batch, seq, "
          "d_model] or [tokens, d_model] with a known d_model. Received: "
          f"input shape {tuple(input_shape)}. Reshape the input to one of "
          "these.")
    return int(input_shape[-1])

  def build(self, input_shape):
    model_dim = self._model_dim(input_shape)
    self.input_spec = keras.layers.InputSpec(
        min_ndim=2, max_ndim=3, axes={-1: model_dim})
    self.router.build((None, model_dim))
    with (placement_lib.per_replica_variables() if self.placement else
          contextlib.nullcontext()):
      for expert in self.experts:
        expert.build((None, model_dim))
    self.tokens_per_expert = self._statistic("tokens_per_expert",
                                             (self.num_experts,))
    self.dropped_fraction = self._statistic("dropped_fraction", ())
    self.load_balancing_loss = self._statistic("load_balancing_loss", ())
    self.router_z_loss = self._statistic("router_z_loss", ())

  def _statistic(self, name: str, shape):
    """A float32 statistic, written by each replica into its own copy and
    read as the replicas' mean (synchronization "on_read", as Keras's
    metrics): `add_weight` has no synchronization argument, and its
    variables would synchronize each write, which a replica cannot do
    inside control flow (tfdist's evaluation step calls the model under a
    `tf.cond`)."""
    with keras.name_scope(self.name, caller=self):
      variable = keras.Variable(
          initializer=keras.initializers.Zeros(), shape=shape,
          dtype="float32", trainable=False, aggregation="mean",
          synchronization="on_read", name=name)
    self._track_variable(variable)
    return variable

  def compute_output_shape(self, input_shape):
    return input_shape

  def _groups(self, tokens):
    """(group_size, groups) of `tokens` rows: Python ints where known."""
    if self.group_size is None:
      return tokens, 1
    if isinstance(tokens, int) and tokens % self.group_size:
      raise ValueError(
          f"MixtureOfExperts (layer {self.name!r}) routes groups of "
          f"group_size={self.group_size} tokens, but the input has "
          f"{tokens} tokens. Pass a batch whose tokens are a multiple of "
          "group_size, or another group_size.")
    # Tokens known only when the graph runs: a remainder fails the reshape.
    return self.group_size, tokens // self.group_size

  def _capacity(self, group_size):
    if isinstance(group_size, int):
      return capacity(group_size, num_experts=self.num_experts,
                      top_k=self.top_k, capacity_factor=self.capacity_factor)
    return tf.cast(tf.math.ceil(
        self.top_k * tf.cast(group_size, tf.float64) * self.capacity_factor
        / self.num_experts), tf.int32)

  def route(self, tokens: tf.Tensor) -> Dict[str, tf.Tensor]:
    """The routing of `tokens` [groups, group_size, d_model].

    Returns:
      A dict of float32 tensors: `dispatch` and `combine`
      [groups, group_size, E, C] (a 0/1 mask, and the gates in the same
      slots), `probs` and `logits` [groups, group_size, E], `first`
      [groups, group_size, E] (one-hot of each token's first choice,
      before capacity), `kept` [groups, group_size, E] (the kept slots,
      summed over choices).
    """
    e = self.num_experts
    logits = self.router(tf.cast(tokens, tf.float32))
    probs = tf.nn.softmax(logits, axis=-1)
    size = tf.shape(tokens)[1] if tokens.shape[1] is None else tokens.shape[1]
    slots = self._capacity(size)
    first = tf.one_hot(_first_max(probs, e), e, dtype=tf.float32)
    masks = [first]
    if self.top_k == 2:
      # Probabilities are >= 0, so -1 takes the first choice out.
      masks.append(tf.one_hot(_first_max(tf.where(first > 0, -1.0, probs),
                                          e), e, dtype=tf.float32))
    gates = [tf.reduce_sum(probs * m, axis=-1) for m in masks]
    if self.top_k == 2:
      total = gates[0] + gates[1] + _GATE_EPSILON
      gates = [g / total for g in gates]
    dispatch = combine = kept = 0.0
    taken = 0.0  # [groups, 1, E]: slots already filled by earlier choices.
    for mask, gate in zip(masks, gates):
      # Position of each token in its expert's queue: tokens before it (in
      # this group) with the same choice, after the earlier choices' slots.
      position = tf.reduce_sum(
          (tf.math.cumsum(mask, axis=1, exclusive=True) + taken) * mask,
          axis=-1)
      keep = mask * tf.cast(position < tf.cast(slots, tf.float32),
                            tf.float32)[..., None]
      taken += tf.reduce_sum(keep, axis=1, keepdims=True)
      # one_hot of a position >= C is all zeros: dropped slots vanish.
      slot = keep[..., None] * tf.one_hot(tf.cast(position, tf.int32), slots,
                                          dtype=tf.float32)[:, :, None, :]
      dispatch += slot
      combine += gate[..., None, None] * slot
      kept += keep
    return {"dispatch": dispatch, "combine": combine, "probs": probs,
            "logits": logits, "first": first, "kept": kept}

  def call(self, inputs):
    shape = tf.shape(inputs)
    model_dim = self._model_dim(inputs.shape)
    tokens = inputs.shape[:-1].num_elements()
    if tokens is None:
      tokens = tf.reduce_prod(shape[:-1])
    group_size, groups = self._groups(tokens)
    x = tf.reshape(inputs, [groups, group_size, model_dim])
    routing = self.route(x)
    dtype = x.dtype
    dispatch = tf.cast(routing["dispatch"], dtype)
    # [E, groups, C, d]: what expert parallelism's all-to-all exchanges.
    expert_inputs = tf.einsum("gsec,gsd->egcd", dispatch, x)
    if self.placement is None:
      expert_outputs = self._run_experts(expert_inputs)
    else:
      expert_outputs = self._run_experts_in_parallel(expert_inputs)
    outputs = tf.einsum("gsec,egcd->gsd", tf.cast(routing["combine"], dtype),
                        expert_outputs)
    self._add_losses_and_statistics(routing)
    return tf.reshape(outputs, shape)

  def _run_experts(self, expert_inputs):
    """Every expert on its rows of `expert_inputs` [n, groups, C, d] (n:
    the experts here, in order): the outputs, same shape and dtype."""
    n, dtype = len(self.experts), expert_inputs.dtype
    shape = tf.shape(expert_inputs)
    flat = tf.reshape(expert_inputs, [n, -1, expert_inputs.shape[-1]])
    outputs = tf.stack([tf.cast(expert(flat[i]), dtype)
                        for i, expert in enumerate(self.experts)])
    return tf.reshape(outputs, shape)

  def _run_experts_in_parallel(self, expert_inputs):
    """Expert parallelism: `expert_inputs` [E, groups, C, d] of this
    replica's tokens go, by all-to-all over its expert group, to the
    replicas holding their experts; each replica runs its L experts on the
    E_p replicas' tokens [L, E_p * groups, C, d], and a second all-to-all
    brings the outputs back: [E, groups, C, d]. The all-to-all's gradient
    is the inverse all-to-all (`collectives.replica_all_to_all`), so each
    expert's weight gradient covers every token of its group sent to it.
    """
    group, _ = self._replica_groups()
    n, local = self.placement.expert_parallel, self._num_local_experts
    shape = tf.shape(expert_inputs)
    model_dim = expert_inputs.shape[-1]
    # [E_p (destination slot), L, groups * C, d].
    sent = tf.reshape(expert_inputs, [n, local, -1, model_dim])
    received = collectives.replica_all_to_all(group, sent, 0, 0)
    # Row q: the tokens of the group's replica q for this replica's experts.
    mine = tf.transpose(received, [1, 0, 2, 3])
    outputs = self._run_experts(mine)
    back = collectives.replica_all_to_all(
        group, tf.transpose(outputs, [1, 0, 2, 3]), 0, 0)
    return tf.reshape(back, shape)

  def _replica_groups(self):
    """(expert group, every replica's group) of the calling replica.

    Raises:
      tfdist.errors.ConfigError: called outside a replica function traced
        by `tf.function` (`collectives.replica_device`).
    """
    device = collectives.replica_device(
        f"MixtureOfExperts (layer {self.name!r}) under expert parallelism")
    replica = self.placement.replica_of(device)
    return self.placement.expert_group(replica), self.placement.all_group()

  def _add_losses_and_statistics(self, routing):
    e = float(self.num_experts)
    first, probs = routing["first"], routing["probs"]
    density = tf.reduce_mean(first, axis=[0, 1])
    density_proxy = tf.reduce_mean(probs, axis=[0, 1])
    kept = tf.reduce_sum(routing["kept"], axis=[0, 1])
    slots_asked = tf.cast(tf.size(first), tf.float32) / e * self.top_k
    z_loss = tf.reduce_mean(tf.square(
        tf.reduce_logsumexp(routing["logits"], axis=-1)))
    if self.placement is not None:
      density, density_proxy, kept, z_loss = self._global_routing(
          density, density_proxy, kept, z_loss)
      slots_asked *= self.placement.num_replicas
    balance = e * tf.reduce_sum(density * density_proxy)
    if self.load_balancing_loss_weight:
      self.add_loss(self.load_balancing_loss_weight * balance)
    if self.router_z_loss_weight:
      self.add_loss(self.router_z_loss_weight * z_loss)
    self.tokens_per_expert.assign(kept)
    self.dropped_fraction.assign(1.0 - tf.reduce_sum(kept) / slots_asked)
    self.load_balancing_loss.assign(balance)
    self.router_z_loss.assign(z_loss)

  def _global_routing(self, density, density_proxy, kept, z_loss):
    """Expert parallelism: f_e, P_e and the z-loss averaged, the kept
    slots summed over every replica (equal token counts per replica): one
    device's values on the global batch, so the losses (and their
    gradients: the all-reduce's is the all-reduce of the upstream ones)
    and statistics equal one device's. Float32 [E], [E], [E], []."""
    _, everyone = self._replica_groups()
    r = float(self.placement.num_replicas)
    e = self.num_experts
    summed = collectives.replica_all_reduce(everyone, tf.concat(
        [density / r, density_proxy / r, kept, [z_loss / r]], 0))
    return summed[:e], summed[e:2 * e], summed[2 * e:3 * e], summed[-1]

  def routing_statistics(self) -> Dict[str, tf.Tensor]:
    """The last call's routing: `tokens_per_expert` float32 [E] (kept
    slots), `dropped_fraction`, `load_balancing_loss` and `router_z_loss`
    (unweighted), float32 scalars. Zeros before the first call.

    Raises:
      ValueError: the layer is not built yet.
    """
    if not self.built:
      raise ValueError(
          f"MixtureOfExperts (layer {self.name!r}) has no statistics before"
          " it is built. Call the layer (or its model) first.")
    return {name: tf.convert_to_tensor(getattr(self, name))
            for name in STATISTICS}

  def get_config(self):
    expert = self.expert
    if expert is not None:
      expert = keras.saving.get_registered_name(expert)
    return {**super().get_config(), "num_experts": self.num_experts,
            "hidden_dim": self.hidden_dim, "top_k": self.top_k,
            "capacity_factor": self.capacity_factor,
            "group_size": self.group_size,
            "activation": keras.activations.serialize(self.activation),
            "expert": expert, "expert_config": dict(self.expert_config),
            "load_balancing_loss_weight": self.load_balancing_loss_weight,
            "router_z_loss_weight": self.router_z_loss_weight,
            "kernel_initializer": keras.initializers.serialize(
                self.kernel_initializer)}

  @classmethod
  def from_config(cls, config):
    config = dict(config)
    name = config.get("expert")
    if isinstance(name, str):
      found = keras.saving.get_registered_object(name)
      if found is None:
        raise ValueError(
            f"MixtureOfExperts config names expert={name!r}, which is not "
            "registered. Register the expert class or function with "
            "keras.saving.register_keras_serializable, or pass it in "
            "custom_objects.")
      config["expert"] = found
    return cls(**config)


def moe_layers(model, *, built_only: bool = False) -> list:
  """Every `MixtureOfExperts` in `model` (a model or layer, itself
  included, searched recursively), with `built_only` only the built ones;
  [] for None."""
  if model is None:
    return []
  return [layer for layer in private_api.flatten_layers(model)
          if isinstance(layer, MixtureOfExperts)
          and (layer.built or not built_only)]


def routing_statistics_of(layers) -> Dict[str, tf.Tensor]:
  """`{"<layer name>/<statistic>": tensor}`: the statistics of each of
  the built `MixtureOfExperts` `layers`
  (`MixtureOfExperts.routing_statistics`: float32; `tokens_per_expert`
  [E], the others scalars)."""
  return {f"{layer.name}/{name}": value
          for layer in layers
          for name, value in layer.routing_statistics().items()}


def model_statistics(model: keras.layers.Layer) -> Dict[str, tf.Tensor]:
  """The routing statistics of every `MixtureOfExperts` in `model` (a
  model or layer, searched recursively), for a trainer's log
  (`routing_statistics_of`). Empty when `model` has none; unbuilt layers
  are left out."""
  return routing_statistics_of(moe_layers(model, built_only=True))


def _check_placement(num_experts: int, top_k: int, placement) -> None:
  """Refuses an expert-parallel layer whose E_p does not divide E.

  Raises:
    tfdist.errors.ConfigError: naming --expert_parallel, E and the fix.
  """
  n, replicas = placement.expert_parallel, placement.num_replicas
  if num_experts % n:
    fits = [d for d in range(2, num_experts + 1)
            if num_experts % d == 0 and replicas % d == 0]
    other = (f"--expert_parallel={wording.either(fits)} (it divides both "
             f"the {num_experts} experts and the {replicas} replicas), or "
             if fits else "")
    raise errors.ConfigError(
        f"--expert_parallel={n} splits each MixtureOfExperts' experts "
        f"evenly over {n} replicas, and num_experts={num_experts} is not a "
        f"multiple of {n}. Use {other}num_experts a multiple of {n} "
        f"({n * max(1, num_experts // n)} or {n * (num_experts // n + 1)}).")
  del top_k


def _check_arguments(*, num_experts, hidden_dim, top_k, capacity_factor,
                     group_size, expert, load_balancing_loss_weight,
                     router_z_loss_weight):
  """Raises ValueError naming the first argument out of range."""
  problems = (
      (int(num_experts) < 1, f"num_experts={num_experts}",
       "Pass num_experts >= 1 (the number of experts)."),
      (int(top_k) not in (1, 2), f"top_k={top_k}",
       "Pass top_k=1 (Switch) or top_k=2 (GShard)."),
      (int(top_k) > int(num_experts),
       f"top_k={top_k} with num_experts={num_experts}",
       "Each token goes to top_k different experts: pass top_k <= "
       "num_experts."),
      (not float(capacity_factor) > 0, f"capacity_factor={capacity_factor}",
       "It makes every expert's capacity 0, so every token would be "
       "dropped. Pass capacity_factor > 0 (1.0 to 2.0 is usual)."),
      (group_size is not None and int(group_size) < 1,
       f"group_size={group_size}",
       "Pass group_size >= 1, or None for one group per call."),
      (float(load_balancing_loss_weight) < 0,
       f"load_balancing_loss_weight={load_balancing_loss_weight}",
       "Pass a weight >= 0 (0: no load-balancing loss)."),
      (float(router_z_loss_weight) < 0,
       f"router_z_loss_weight={router_z_loss_weight}",
       "Pass a weight >= 0 (0: no router z-loss)."),
      (expert is None and (hidden_dim is None or int(hidden_dim) < 1),
       f"hidden_dim={hidden_dim}",
       "The default experts need hidden_dim >= 1, or pass expert=..."),
  )
  for bad, received, fix in problems:
    if bad:
      raise ValueError(f"MixtureOfExperts: invalid argument. Received: "
                       f"{received}. {fix}")
