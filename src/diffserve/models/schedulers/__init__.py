"""models/schedulers"""
