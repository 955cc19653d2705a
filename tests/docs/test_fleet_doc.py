"""docs/fleet.md's peer-to-peer config loads as written and makes the node it describes."""

from __future__ import annotations

import re

import yaml

from kvtier import Config
from kvtier.p2p.node import P2PNode
from tests.docs.doc_blocks import ROOT

HEADING = "## Peer-to-peer: a miss here is a hit on another host"
FENCE = re.compile(r"```yaml\n(.*?)```", re.S)


def test_the_p2p_config_loads_and_names_a_node() -> None:
    # (doc_blocks.section would end the section at the YAML's own "# ..." comment line)
    text = (ROOT / "docs" / "fleet.md").read_text()
    part = text[text.index(HEADING) :].split("\n## ", 1)[0]
    (block,) = FENCE.findall(part)
    values = yaml.safe_load(block)
    env = {"KVTIER_P2P_AUTH_TOKEN": "a-fleet-secret-of-32-characters!"}  # as the doc says
    config = Config.load(overrides=values, env=env)
    node = P2PNode.from_config(config)
    assert node is not None and node.address == values["p2p_listen"]
    # The host's own address is in the list: it follows the other two, not itself.
    assert node.address in node.peers and len(node.peers) == 3
    assert node.token == env["KVTIER_P2P_AUTH_TOKEN"] and node.lease_secs == 3
