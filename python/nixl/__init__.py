# pdrouter's stand-in for NIXL's package: nixl._api.nixl_agent moves bytes through kvproxy.
