"""Generated code for the kubelet plugin registration API (the plugin watcher's `pluginregistration`)."""
