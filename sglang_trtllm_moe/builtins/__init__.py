"""Built-in capabilities: each module implements the plugin's hookspecs like a third-party extension would."""
