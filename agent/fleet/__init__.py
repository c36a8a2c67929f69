"""`gpu-node-agent fleet`: the operator's read-only view of every node, from what the agents wrote on the Nodes.

- `verdicts`: one node's verdict, cordon, latch, GPU counts and incidents; the fleet's totals.
- `report`: the paginated LIST through the cluster port (`agent.kube.port.NodeListApi`) and the text/JSON output.
"""
