"""models/vaes"""
