"""Rollouts: what samples the student's on-policy completions (``on_policy.sampler``).

:mod:`kd.rollouts.base` is the interface (:class:`~kd.rollouts.base.Sampler`, the prompts and
completions it trades), :mod:`kd.rollouts.build` picks the implementation
(:func:`~kd.rollouts.build.sampler_for`), :mod:`kd.rollouts.local` is the student in this
process, and :mod:`kd.rollouts.plan` what each costs in the memory plan. This package module
imports nothing, so the planner (no torch) can import :mod:`kd.rollouts.plan`.
"""
