"""Which device each pool member trains on (`undertow/cells/elastic/devices.py`), as pure
functions of what a process can see, with fake GPU counts and visible-device lists:

- "auto" is resolved once by the driver: CUDA where it sees a GPU, else the CPU.
- `learner.device: cuda` without CUDA, and a sharded cell of more processes than the
  node's GPUs, are refused naming the field (and are ValueErrors, which the command
  line prints as one line).
- On one machine cells take consecutive blocks of GPUs, wrapping around (two one-GPU
  cells on one GPU share cuda:0); the processes of one cell never share a GPU.
- Under Ray, the member's GPU is the one Ray assigned, found in the actor's
  CUDA_VISIBLE_DEVICES (index 0 as Ray sets it; its own id when nothing is hidden).
- A Ray cell is refused when no live node holds its GPUs.
"""

import pytest

from undertow.cells.elastic.devices import (
    MemberDeviceError,
    assigned_device_index,
    check_cell_gpus,
    check_member_devices,
    local_device_index,
    member_device_name,
)
from undertow.learner.sharding import DeviceError


def test_auto_is_resolved_by_what_the_driver_sees():
    assert member_device_name("auto", cuda_available=False) == "cpu"
    assert member_device_name("auto", cuda_available=True) == "cuda"
    assert member_device_name("cpu", cuda_available=True) == "cpu"
    assert member_device_name("cuda", cuda_available=False) == "cuda"


def test_cuda_without_cuda_is_refused_naming_the_field():
    with pytest.raises(MemberDeviceError, match=r"learner\.device is 'cuda'") as caught:
        check_member_devices("cuda", cuda_available=False, num_gpus=0)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, DeviceError)
    check_member_devices("auto", cuda_available=False, num_gpus=0)   # the CPU: fine
    check_member_devices("cpu", cuda_available=False, num_gpus=0, processes_per_cell=4)


def test_a_cell_of_more_gpus_than_the_node_has_is_refused():
    with pytest.raises(MemberDeviceError, match=r"pool\.processes_per_cell=4 .* has 2"):
        check_member_devices("cuda", cuda_available=True, num_gpus=2, processes_per_cell=4)
    with pytest.raises(MemberDeviceError, match=r"pool\.processes_per_cell=2"):
        check_member_devices("auto", cuda_available=True, num_gpus=1, processes_per_cell=2)
    check_member_devices("cuda", cuda_available=True, num_gpus=2, processes_per_cell=2)


def test_local_cells_take_blocks_of_gpus_wrapping_around():
    # 8 GPUs, cells of 2 processes: cell 0 -> 0,1; cell 1 -> 2,3; ... cell 4 -> 0,1 again.
    assert [[local_device_index(cell, rank, 2, 8) for rank in range(2)]
            for cell in range(5)] == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]]
    # one GPU, one-process cells: every cell on cuda:0 (the device check's smoke case).
    assert [local_device_index(cell, 0, 1, 1) for cell in range(3)] == [0, 0, 0]
    # 3 GPUs, cells of 2: a block never wraps inside itself, GPU 2 stays unused.
    assert [[local_device_index(cell, rank, 2, 3) for rank in range(2)]
            for cell in range(3)] == [[0, 1], [0, 1], [0, 1]]
    with pytest.raises(MemberDeviceError, match="more GPUs than the 2 visible"):
        local_device_index(0, 0, 4, 2)
    with pytest.raises(MemberDeviceError, match="no GPU is visible"):
        local_device_index(0, 0, 1, 0)


def test_a_ray_member_takes_the_gpu_ray_assigned():
    assert assigned_device_index(["3"], "3") == 0              # Ray narrows the visible set
    assert assigned_device_index(["5", "6"], "5,6") == 0
    assert assigned_device_index(["2"], "0,1,2,3") == 2        # nothing hidden
    assert assigned_device_index(["1"], None) == 1
    with pytest.raises(MemberDeviceError, match="gpus_per_member"):
        assigned_device_index([], "0")
    with pytest.raises(MemberDeviceError, match="CUDA_VISIBLE_DEVICES is '0,1'"):
        assigned_device_index(["4"], "0,1")


def test_a_ray_cell_must_fit_on_one_node():
    check_cell_gpus(0.0, [])                                   # a CPU cell asks for no GPU
    check_cell_gpus(1.0, [0.0, 8.0])
    check_cell_gpus(0.5, [1.0])
    with pytest.raises(MemberDeviceError, match=r"asks for 2 GPUs .* largest node .* has 1"):
        check_cell_gpus(2.0, [1.0, 1.0])
    with pytest.raises(MemberDeviceError, match="has 0"):
        check_cell_gpus(1.0, [0.0])
