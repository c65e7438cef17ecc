"""Which interface multi-node CPU ranks use (overlap.launch.interfaces), and the one line for a lost
peer. The real choice over a real interface runs in tests/test_two_nodes.py."""

from __future__ import annotations

import pytest

from overlap.errors import ConfigError
from overlap.launch.interfaces import gloo_interface, lost_peer

TWO_NODES = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"}


def test_one_node_or_the_users_own_choice_sets_nothing():
    assert (
        gloo_interface({**TWO_NODES, "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "localhost"}) is None
    )
    assert (
        gloo_interface({**TWO_NODES, "MASTER_ADDR": "localhost", "GLOO_SOCKET_IFNAME": "eth7"})
        is None
    )


def test_a_loopback_master_addr_across_nodes_is_one_clear_error():
    with pytest.raises(ConfigError) as info:
        gloo_interface({**TWO_NODES, "MASTER_ADDR": "localhost"})
    assert (
        info.value.field == "MASTER_ADDR"
        and "loopback" in info.value.why
        and "--local-addr" in info.value.fix
    )


@pytest.mark.parametrize(
    "env, field",
    [
        ({**TWO_NODES, "MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR"),
        ({**TWO_NODES, "MASTER_ADDR": ""}, "MASTER_ADDR"),
        ({**TWO_NODES, "LOCAL_WORLD_SIZE": "two", "MASTER_ADDR": "localhost"}, "LOCAL_WORLD_SIZE"),
    ],
)
def test_values_a_multi_node_world_cannot_use_are_named(env, field):
    with pytest.raises(ConfigError) as info:
        gloo_interface(env)
    assert info.value.field == field


def test_a_lost_peer_is_named_by_its_ranks():
    error = (
        "[../gloo/transport/tcp/pair.cc:537] Read error [10.77.0.2]:49304: Connection reset by "
        "peer. This is typically caused by a remote worker hanging"
    )
    hosts = {"10.77.0.1": [0, 1], "10.77.0.2": [2, 3]}
    assert lost_peer(error, 1, 4, hosts).startswith(
        "rank 1 of 4 lost its connection to ranks 2, 3 on 10.77.0.2 (Connection reset by peer): "
    )
    assert "the peer at 10.77.0.2" in lost_peer(error, 1, 4, {})
    assert lost_peer("RuntimeError: shapes do not match", 1, 4, hosts) is None


def test_a_silent_peer_names_the_timeout():
    error = (
        "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation "
        "to complete"
    )
    assert lost_peer(error, 0, 2, {}).startswith(
        "rank 0 of 2 got no answer from its peers for train.comm_timeout_s=5 s (a recv never "
        "completed): "
    )
