"""DRA driver: the kubelet DRA plugin (registration, prepare/unprepare, CDI specs) and the ResourceSlice publisher."""
