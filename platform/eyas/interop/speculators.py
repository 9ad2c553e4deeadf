"""placeholder"""
def eagle3_config(model, target_ref): raise NotImplementedError
def dflash_config(model, target_ref): raise NotImplementedError
def drafter_type(config, where): raise NotImplementedError
def engine_config(config, target, where): raise NotImplementedError
