"""The executor process: owns the models, their queues and executors; serves front ends."""
