"""The ascend target's executor: every pyACL call (acl_api.py), its pure logic (acl_plan.py) and the executor
(acl_executor.py). NOT RUN ON HARDWARE (README, "Running on Ascend")."""
