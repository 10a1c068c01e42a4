# pdrouter's stand-in for Mooncake's package: mooncake.engine.TransferEngine moves bytes through kvproxy.
