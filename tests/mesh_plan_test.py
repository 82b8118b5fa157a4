"""The planner's meshes (tfdist/training/plan/mesh_plan.py).

* every factorization of N devices with every ZeRO stage is listed, in
  recommendation order;
* a mesh with one axis equals the single-axis table's row of that layout
  (data parallelism and ZeRO 1-3 over N, a pipeline of N stages, tensor
  parallelism over N): the two tables cannot drift apart;
* a hand-computed D2 x P2 x T1 at ZeRO 1, and D2 x P1 x T2 at ZeRO 1
  (hybrid sharding: ZeRO inside each data group of the tensor mesh);
* the recommendation: the first runnable layout that fits, so shrinking the
  memory walks it from data parallelism to ZeRO to a pipeline; a layout
  tfdist cannot run is never recommended;
* a model a layout map splits: with `--layout_map` the pipeline x
  tensor, data x tensor and D x P x T meshes at the map's T, with the
  flags that run them (one recommended when only it fits); other T's
  refused naming the map's axis; without a map those rows say a layout
  map is needed; the Transformer's split stays out of a pipeline;
* diagnose's plan prints the meshes (tfdist.diagnose --plan_only).
"""

import dataclasses

from absl.testing import absltest

from tfdist.training.plan import memory
from tfdist.training.plan import mesh_plan

MiB = 1 << 20
# Adam in fp32: weights W, gradients W, two slots 2W (+8 bytes of counts).
_ESTIMATE = memory.ModelMemory(parameters_bytes=64 * MiB,
                               gradients_bytes=64 * MiB,
                               optimizer_bytes=128 * MiB + 8,
                               num_parameters=16 * MiB)


def _choice(num_devices=4, capacity=10 << 30, **kwargs):
  args = dict(num_devices=num_devices, capacity_bytes=capacity,
              shared_memory=False, global_batch_size=64,
              activation_bytes_per_example=MiB // 4, optimizer="adam",
              tensor_parallel_bytes=32 * MiB,
              tensor_parallel_flag=f"--tensor_parallel={num_devices}")
  args.update(kwargs)
  return memory.layout_table(_ESTIMATE, **args)


def _by_name(layouts):
  return {m.name: m for m in layouts}


def _state(row):
  return (row.parameters_bytes, row.gradients_bytes, row.optimizer_bytes,
          row.activations_bytes)


class MeshLayoutsTest(absltest.TestCase):

  def test_every_mesh_and_stage_in_order(self):
    layouts = mesh_plan.mesh_layouts(_choice(4).facts)
    names = [m.name for m in layouts]
    self.assertLen(names, 15)  # 3 meshes with D > 1 x 4 stages + 3.
    self.assertEqual(names[:4], ["D4 x P1 x T1", "D4 x P1 x T1, ZeRO 1",
                                 "D4 x P1 x T1, ZeRO 2",
                                 "D4 x P1 x T1, ZeRO 3"])
    self.assertEqual(names[4], "D2 x P2 x T1")
    self.assertEqual(names[-1], "D1 x P2 x T2")
    for m in layouts:
      self.assertEqual(m.data * m.pipeline * m.tensor, 4)

  def test_one_axis_meshes_equal_the_single_axis_rows(self):
    choice = _choice(4, gradient_accumulation=True)
    rows = {r.layout: r for r in choice.rows}
    meshes = _by_name(mesh_plan.mesh_layouts(choice.facts))
    self.assertEqual(_state(meshes["D4 x P1 x T1"].memory),
                     _state(rows["data parallel"]))
    for z in (1, 2, 3):
      self.assertEqual(_state(meshes[f"D4 x P1 x T1, ZeRO {z}"].memory),
                       _state(rows[f"ZeRO {z}"]), z)
    self.assertEqual(_state(meshes["D1 x P1 x T4"].memory),
                     _state(rows["tensor parallel"]))
    # The pipeline row picks the fewest stages that fit (2 here).
    pipeline = rows["pipeline"]
    self.assertEqual(pipeline.devices, 2)
    two = mesh_plan.mesh_layouts(_choice(
        2, gradient_accumulation=True, tensor_parallel_flag="").facts)
    self.assertEqual(_state(_by_name(two)["D1 x P2 x T1"].memory),
                     _state(pipeline))

  def test_hand_computed_data_by_pipeline_at_zero_1(self):
    m = _by_name(mesh_plan.mesh_layouts(_choice(4).facts))[
        "D2 x P2 x T1, ZeRO 1"]
    row = m.memory
    self.assertEqual(row.parameters_bytes, 32 * MiB)   # W / P
    # G / P, and the stage's packed gradients for the copies' all-reduce.
    self.assertEqual(row.gradients_bytes, 64 * MiB)
    self.assertEqual(row.optimizer_bytes, 32 * MiB + 2)  # O / P / D
    # GPipe, M = P = 2 micro-batches of the copy's B/D = 32 examples,
    # all in flight: a * 32 * 2 / (2 * 2).
    self.assertEqual(row.activations_bytes, MiB // 4 * 16)
    # A ring all-reduce over D = 2 of the stage's 32 MiB of gradients
    # (32 MiB) and the all-gather of the updated weights (16 MiB).
    self.assertEqual(m.data_traffic_bytes, 48 * MiB)
    meshes = _by_name(mesh_plan.mesh_layouts(_choice(4).facts))
    self.assertEqual(meshes["D2 x P2 x T1"].data_traffic_bytes, 32 * MiB)
    self.assertEqual(meshes["D4 x P1 x T1, ZeRO 3"].data_traffic_bytes,
                     192 * MiB)  # 4 * 3/4 * 64 MiB
    self.assertEqual(meshes["D1 x P4 x T1"].data_traffic_bytes, 0)
    self.assertEqual(row.flags, "--pipeline_stages=2 --num_gpus=4 "
                     "--zero_stage=1")
    tensor = _by_name(mesh_plan.mesh_layouts(_choice(4).facts))[
        "D2 x P1 x T2"].memory
    self.assertTrue(tensor.available)
    self.assertEqual(tensor.flags, "--distribution_strategy=mirrored "
                     "--tensor_parallel=2 --num_gpus=4")
    self.assertIn("ZeRO beside a pipeline", row.note)
    plain = _by_name(mesh_plan.mesh_layouts(_choice(4).facts))["D2 x P2 x T1"]
    self.assertTrue(plain.memory.available)
    self.assertEqual(m.to_dict()["zero_stage"], 1)

  def test_hand_computed_data_by_tensor_at_zero_1(self):
    # Hybrid sharding: ZeRO 1 inside each data group of a D2 x T2 mesh.
    # The split layers hold half the weights (32 of 64 MiB), so one
    # device keeps 1 - 1/2 x 1/2 = 3/4 of each state (t_T), and the
    # optimizer state's 3/4 over D = 2.
    meshes = _by_name(mesh_plan.mesh_layouts(_choice(4).facts))
    m = meshes["D2 x P1 x T2, ZeRO 1"]
    row = m.memory
    self.assertTrue(row.available, row.note)
    self.assertEqual(row.parameters_bytes, 48 * MiB)
    self.assertEqual(row.gradients_bytes, 48 * MiB)
    self.assertEqual(row.optimizer_bytes, 48 * MiB + 3)  # (128 MiB + 8) 3/8
    self.assertEqual(row.flags, "--distribution_strategy=mirrored "
                     "--tensor_parallel=2 --num_gpus=4 --zero_stage=1")
    # All-reduce and all-gather over D = 2: 3 x 1/2 x 48 MiB.
    self.assertEqual(m.data_traffic_bytes, 72 * MiB)
    self.assertTrue(meshes["D2 x P1 x T2, ZeRO 2"].memory.available)
    self.assertIn("ZeRO stage 3 beside tensor parallelism is not built yet",
                  meshes["D2 x P1 x T2, ZeRO 3"].memory.note)

  def test_recommendation_walks_as_memory_shrinks(self):
    def best(capacity):
      choice = _choice(4, capacity=capacity)
      found = mesh_plan.recommended(mesh_plan.mesh_layouts(choice.facts))
      return found.name if found else None

    self.assertEqual(best(10 << 30), "D4 x P1 x T1")
    # Data parallelism holds 256 MiB + 4 MiB of activations; ZeRO 1 96.
    self.assertEqual(best(200 * MiB), "D4 x P1 x T1, ZeRO 1")
    # ZeRO 3 and 4 stages both hold 64 MiB of state + 4 MiB of
    # activations (and 8 bytes of counts): ZeRO 3 is cheaper in
    # communication.
    self.assertEqual(best(69 * MiB), "D4 x P1 x T1, ZeRO 3")
    self.assertIsNone(best(68 * MiB))

  def test_unavailable_layouts_are_never_recommended(self):
    facts = dataclasses.replace(_choice(4, capacity=69 * MiB).facts,
                                shardable=False, optimizer="lamb")
    layouts = mesh_plan.mesh_layouts(facts)
    names = _by_name(layouts)
    self.assertIn("cannot be sharded",
                  names["D4 x P1 x T1, ZeRO 1"].memory.note)
    self.assertFalse(names["D4 x P1 x T1, ZeRO 3"].memory.fits)
    self.assertEqual(mesh_plan.recommended(layouts).name, "D1 x P4 x T1")
    text = mesh_plan.render(layouts, 69 * MiB)
    self.assertIn("Recommended mesh: D1 x P4 x T1 (--pipeline_stages=4)",
                  text)
    self.assertIn("n/a: --optimizer=lamb cannot be sharded", text)
    tiny = dataclasses.replace(facts, capacity_bytes=MiB)
    none = mesh_plan.render(mesh_plan.mesh_layouts(tiny), MiB)
    self.assertIn("No mesh fits 1.0 MiB: the smallest tfdist runs is "
                  "D1 x P4 x T1", none)


class LayoutMapMeshesTest(absltest.TestCase):
  """A model of one's own that a layout map splits: with `--layout_map`
  the planner proposes data x tensor, pipeline x tensor and D x P x T at
  the map's T with the flags that run them; without a map those rows say
  a layout map is needed; the Transformer's split still stays out of a
  pipeline's stages."""

  def layouts(self, capacity=100 * MiB, **kwargs):
    # The whole model splits over T (tensor_parallel_bytes = W); one
    # layer holds half of the weights (a stage of 2 or 4 holds 1/2);
    # LAMB cannot be sharded (no ZeRO rows).
    args = dict(capacity=capacity, optimizer="lamb",
                tensor_parallel_bytes=64 * MiB, tensor_parallel_flag="",
                pipeline_shares={2: 0.5, 4: 0.5})
    args.update(kwargs)
    choice = _choice(4, **args)
    return choice, mesh_plan.mesh_layouts(choice.facts)

  def test_a_flag_map_is_proposed_at_its_t_with_its_flags(self):
    choice, layouts = self.layouts(layout_map="my_mlp:layout_map",
                                   layout_map_degree=2)
    names = _by_name(layouts)
    pxt = names["D1 x P2 x T2"].memory
    self.assertTrue(pxt.available, pxt.note)
    # s_P t_T = 1/2 x 1/2 of the 256 MiB of state, + GPipe's activations.
    self.assertEqual(pxt.parameters_bytes, 16 * MiB)
    self.assertEqual(pxt.flags,
                     "--pipeline_stages=2 --layout_map=my_mlp:layout_map")
    self.assertEqual(names["D2 x P1 x T2"].memory.flags,
                     "--distribution_strategy=mirrored "
                     "--layout_map=my_mlp:layout_map --num_gpus=4")
    self.assertTrue(names["D2 x P1 x T2"].memory.available)
    # The map's mesh fixes T = 2: T = 4 needs another map.
    self.assertIn("--layout_map=my_mlp:layout_map has a 'model' axis of 2: "
                  "T = 4 needs a map whose 'model' axis is 4",
                  names["D1 x P1 x T4"].memory.note)
    # Only D1 x P2 x T2 fits 100 MiB: recommended, with its flags.
    self.assertEqual(mesh_plan.recommended(layouts).name, "D1 x P2 x T2")
    self.assertIn("Recommended mesh: D1 x P2 x T2 (--pipeline_stages=2 "
                  "--layout_map=my_mlp:layout_map)",
                  mesh_plan.render(layouts, choice.capacity_bytes))
    # The single-axis table's tensor row: T = N = 4, not the map's.
    row = {r.layout: r for r in choice.rows}["tensor parallel"]
    self.assertFalse(row.available)
    self.assertIn("'model' axis of 2", row.note)
    eight = _choice(8, capacity=10 << 30, tensor_parallel_flag="",
                    layout_map="my_mlp:layout_map", layout_map_degree=2)
    dxpxt = _by_name(mesh_plan.mesh_layouts(eight.facts))["D2 x P2 x T2"]
    self.assertTrue(dxpxt.memory.available, dxpxt.memory.note)
    self.assertEqual(dxpxt.memory.flags,
                     "--pipeline_stages=2 --layout_map=my_mlp:layout_map "
                     "--num_gpus=8")

  def test_without_a_map_the_rows_say_one_is_needed(self):
    choice, layouts = self.layouts()
    names = _by_name(layouts)
    for name in ("D1 x P2 x T2", "D2 x P1 x T2", "D1 x P1 x T4"):
      with self.subTest(name=name):
        row = names[name].memory
        self.assertFalse(row.available)
        self.assertIn("--layout_map=package.module:function (a layout map "
                      "is needed", row.note)
        self.assertIn("--layout_map=package.module:function", row.flags)
    self.assertIsNone(mesh_plan.recommended(layouts))
    self.assertIn("No mesh fits 100.0 MiB",
                  mesh_plan.render(layouts, choice.capacity_bytes))

  def test_the_transformers_split_stays_out_of_a_pipeline(self):
    _, layouts = self.layouts(tensor_parallel_flag="--tensor_parallel=4")
    names = _by_name(layouts)
    self.assertIn("does not run inside a pipeline's stages",
                  names["D1 x P2 x T2"].memory.note)
    self.assertTrue(names["D2 x P1 x T2"].memory.available)
    self.assertEqual(names["D2 x P1 x T2"].memory.flags,
                     "--distribution_strategy=mirrored --tensor_parallel=2 "
                     "--num_gpus=4")


if __name__ == "__main__":
  absltest.main()
