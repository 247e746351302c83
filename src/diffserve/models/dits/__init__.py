"""models/dits"""
