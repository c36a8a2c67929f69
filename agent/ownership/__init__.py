"""Who holds which device, from the kubelet (PodResources) and the own-node pod specs: for placement, metrics
and pod Events. The kubelet's word replaces the agent's guesses wherever it is available."""
